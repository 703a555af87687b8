# Print the dependency closure (Pre-Depends + Depends) of the packages named
# in the space-separated variable KEEP, computed over the installed packages
# of a dpkg status file. Alternatives ("a | b") resolve to the first one that
# is installed (directly or via Provides). Packages named in DROP are treated
# as if the dependency were satisfied without them (used for install-time-only
# dependencies such as dpkg or debianutils) unless KEEP names them itself.
# One package name per output line.
#
#   awk -v KEEP="dash coreutils" -v DROP="dpkg tar" -f closure.awk ROOT/var/lib/dpkg/status
function flush() {
    if (pkg != "" && installed) {
        inst[pkg] = 1
        deps[pkg] = dep
        n = split(prov, pv, ",")
        for (i = 1; i <= n; i++) {
            p = pv[i]; sub(/\(.*/, "", p); gsub(/[ \t]/, "", p); sub(/:.*/, "", p)
            if (p != "" && !(p in provider)) provider[p] = pkg
        }
    }
    pkg = ""; dep = ""; prov = ""; installed = 0; field = ""
}
/^$/ { flush(); next }
/^[ \t]/ { if (field == "dep") dep = dep $0; else if (field == "prov") prov = prov $0; next }
{
    field = ""
    if ($1 == "Package:") pkg = $2
    else if ($1 == "Status:") installed = ($0 ~ / installed$/)
    else if ($1 == "Depends:" || $1 == "Pre-Depends:") { sub(/^[^:]*:/, ""); dep = dep "," $0; field = "dep" }
    else if ($1 == "Provides:") { sub(/^[^:]*:/, ""); prov = prov "," $0; field = "prov" }
}
function resolve(name) {
    sub(/\(.*/, "", name); gsub(/[ \t]/, "", name); sub(/:.*/, "", name)
    if (name in inst) return name
    if (name in provider) return provider[name]
    return ""
}
END {
    flush()
    nq = split(KEEP, queue, /[ \t\n,]+/)
    nd = split(DROP, dl, /[ \t\n,]+/)
    for (i = 1; i <= nd; i++) if (dl[i] != "") dropped[dl[i]] = 1
    for (i = 1; i <= nq; i++) delete dropped[queue[i]]
    head = 1
    while (head <= nq) {
        p = resolve(queue[head++])
        if (p == "" || (p in keep)) continue
        keep[p] = 1
        ng = split(deps[p], groups, ",")
        for (g = 1; g <= ng; g++) {
            if (groups[g] ~ /^[ \t]*$/) continue
            na = split(groups[g], alts, "|")
            for (a = 1; a <= na; a++) {
                r = resolve(alts[a])
                if (r in dropped) break
                if (r != "") { queue[++nq] = r; break }
            }
        }
    }
    for (p in keep) print p
}
