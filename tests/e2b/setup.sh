#!/usr/bin/env bash
# Makes the clients of the E2B scenario suite (tests/e2b, run by sandboxd/tests/suite/e2b_sdk.rs): the unchanged
# e2b SDKs, pinned, under DIR (default /var/cache/sandboxd-test):
#   DIR/e2b-venv   a Python venv with e2b 2.63.0, e2b-code-interpreter 2.11.5, pytest and pytest-timeout (PyPI; the other packages held to the
#                  versions below by a constraints list, so a new release upstream cannot change a CI run)
#   DIR/e2b-node   an npm directory with e2b 2.51.0 in node_modules (npm; its lock file is kept there)
# Each is reused while its marker file holds exactly the pins (and, for the venv, the interpreter) of this script and
# the SDK still imports; otherwise it is made again in place. Progress goes to stderr; stdout is two
# shell assignments, so a caller can take them with
#   e2b_env=$(tests/e2b/setup.sh) && eval "$e2b_env" && export SANDBOXD_TEST_E2B_VENV SANDBOXD_TEST_E2B_NODE
# (not `eval "$(tests/e2b/setup.sh)"`: eval of a failed substitution succeeds).
# Needs python3 with venv (Debian: the python3.X-venv package) and npm (Debian: npm; NodeSource's nodejs has it).
set -euo pipefail
dir=${1:-/var/cache/sandboxd-test}
python=${PYTHON:-python3}

e2b_py=2.63.0
code_interpreter=2.11.5
pytest=9.2.0
pytest_timeout=2.4.0
e2b_js=2.51.0
# What pip resolved for the pins above (pip freeze, Python 3.11); constraints, not requirements: a package a
# Python version does not need is not installed.
constraints="anyio==4.16.0
attrs==26.1.0
bracex==3.2.4
certifi==2026.10.19.post1
connectrpc==0.12.1
e2b-dockerfile-utils==0.1.1
h11==0.16.0
h2==4.4.1
hpack==4.2.0
httpcore==1.0.9
httpx==0.29.0
hyperframe==6.1.0
idna==3.21
iniconfig==2.3.1
markdown-it-py==4.3.0
mdurl==0.1.2
opentelemetry-api==1.45.3
packaging==26.4
pluggy==1.7.0
protobuf-py==0.6.0
protobuf-py-ext==0.6.0
Pygments==2.21.0
pyqwest==0.12.0
python-dateutil==4.0.0
rich==15.0.0
typing_extensions==4.16.0
tzdata==2026.6
wcmatch==11.2"

say() { echo "tests/e2b/setup.sh: $*" >&2; }
die() { say "$*"; exit 1; }

mkdir -p "$dir"
# One setup at a time per DIR (CI and a developer's run may share the cache).
exec 9>"$dir/.e2b-setup.lock"
flock 9

venv="$dir/e2b-venv"
node_dir="$dir/e2b-node"

"$python" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' 2>/dev/null \
  || die "$python is missing or older than 3.10 (e2b $e2b_py needs 3.10+)"
py_id="$("$python" -c 'import sys; print(sys.executable, "%d.%d.%d" % sys.version_info[:3])')"
venv_mark="e2b==$e2b_py e2b-code-interpreter==$code_interpreter pytest==$pytest pytest-timeout==$pytest_timeout python=$py_id constraints=$(
  printf '%s' "$constraints" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.sandboxd-pins" 2>/dev/null)" = "$venv_mark" ] \
  && "$venv/bin/python" -c 'import e2b, e2b_code_interpreter, pytest, pytest_timeout' 2>/dev/null; then
  say "reusing $venv ($venv_mark)"
else
  "$python" -c 'import ensurepip, venv' 2>/dev/null || die "$python has no venv/ensurepip: apt-get install python$(
    "$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
  say "making $venv ($venv_mark)"
  # Made in place (a venv's scripts name its path); the marker, written last, is what makes it reusable.
  rm -rf "$venv"
  "$python" -m venv "$venv"
  printf '%s\n' "$constraints" >"$venv/constraints.txt"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-input -c "$venv/constraints.txt" \
    "e2b==$e2b_py" "e2b-code-interpreter==$code_interpreter" "pytest==$pytest" "pytest-timeout==$pytest_timeout" >&2
  "$venv/bin/python" -c 'import e2b, e2b_code_interpreter, pytest, pytest_timeout' \
    || die "$venv: the SDK does not import"
  echo "$venv_mark" >"$venv/.sandboxd-pins"
fi

command -v npm >/dev/null 2>&1 || die "npm is missing (apt-get install npm)"
node_mark="e2b@$e2b_js node=$(node --version)"
if [ "$(cat "$node_dir/.sandboxd-pins" 2>/dev/null)" = "$node_mark" ] \
  && (cd "$node_dir" && node --input-type=module -e 'await import("e2b")') 2>/dev/null; then
  say "reusing $node_dir ($node_mark)"
else
  say "making $node_dir ($node_mark)"
  rm -rf "$node_dir"
  mkdir -p "$node_dir"
  printf '{"name": "sandboxd-e2b-clients", "private": true}\n' >"$node_dir/package.json"
  (cd "$node_dir" && npm install --no-audit --no-fund --no-update-notifier --save-exact --loglevel=error \
    "e2b@$e2b_js" >&2)
  (cd "$node_dir" && node --input-type=module -e 'await import("e2b")') || die "$node_dir: the npm e2b does not import"
  echo "$node_mark" >"$node_dir/.sandboxd-pins"
fi

printf 'SANDBOXD_TEST_E2B_VENV=%q\n' "$venv"
printf 'SANDBOXD_TEST_E2B_NODE=%q\n' "$node_dir/node_modules"
