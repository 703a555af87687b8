//! Which resolved addresses the proxy may connect to, whatever the allowlist says: the special-purpose ranges, the
//! daemon's listen addresses, and the host's own interface addresses; and the networks an operator permits within
//! the special-purpose ranges ([`parse_allowed_networks`], [`AddressPolicy::allow_networks`]).

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressRefusal {
    /// 127.0.0.0/8, ::1.
    Loopback,
    /// RFC 1918 and ULA fc00::/7 (allowed with `allow_private`, or inside `allow_networks`).
    Private,
    /// 169.254.0.0/16 (cloud metadata), fe80::/10, and the deprecated site-local fec0::/10.
    LinkLocal,
    /// Shared address space 100.64.0.0/10 (allowed inside `allow_networks`).
    SharedCgnat,
    /// Multicast.
    Multicast,
    /// 0.0.0.0/8, ::.
    Unspecified,
    /// 255.255.255.255 and 240.0.0.0/4.
    Reserved,
    /// The other special-purpose ranges (IANA's registries, RFC 6890): IETF protocol assignments 192.0.0.0/24,
    /// documentation 192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32 and 3fff::/20, benchmarking
    /// 198.18.0.0/15, the deprecated 6to4 relay 192.88.99.0/24, local-use NAT64 64:ff9b:1::/48, discard 100::/64,
    /// IETF protocol assignments 2001::/23 (Teredo, benchmarking 2001:2::/48, ORCHID among them), SRv6 5f00::/16.
    /// Allowed inside `allow_networks`.
    SpecialPurpose,
    /// One of the daemon's own listen addresses.
    DaemonAddress,
    /// One of the host's own interface addresses (every port: a service listening on `0.0.0.0` answers on it).
    HostAddress,
    /// The host's interface addresses could not be read, so no address can be told apart from them.
    HostAddressesUnknown,
}

impl fmt::Display for AddressRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressRefusal::Loopback => "loopback address",
            AddressRefusal::Private => "private address",
            AddressRefusal::LinkLocal => "link-local address",
            AddressRefusal::SharedCgnat => "shared (CGNAT) address",
            AddressRefusal::Multicast => "multicast address",
            AddressRefusal::Unspecified => "unspecified address",
            AddressRefusal::Reserved => "reserved address",
            AddressRefusal::SpecialPurpose => "special-purpose address",
            AddressRefusal::DaemonAddress => "the daemon's own address",
            AddressRefusal::HostAddress => "the host's own address",
            AddressRefusal::HostAddressesUnknown => "the host's addresses could not be read",
        })
    }
}

/// The host's own addresses at one moment, as [`classify`] compares them (IPv4 forms of IPv6 addresses that embed
/// one), sorted; shared, so the cached set is handed to each resolution without a copy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostAddresses(Arc<[IpAddr]>);

impl HostAddresses {
    /// The addresses of every interface of the host (up or down), read with getifaddrs(3): one netlink dump.
    pub fn read() -> io::Result<HostAddresses> {
        let addresses = nix::ifaddrs::getifaddrs()?.filter_map(|interface| {
            let address = interface.address?;
            match (address.as_sockaddr_in(), address.as_sockaddr_in6()) {
                (Some(v4), _) => Some(IpAddr::V4(v4.ip())),
                (_, Some(v6)) => Some(IpAddr::V6(v6.ip())),
                _ => None,
            }
        });
        Ok(HostAddresses::from_iter(addresses))
    }

    /// The addresses.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.0.iter().copied()
    }

    /// Whether `ip`, in any form that embeds it, is one of these addresses.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.binary_search(&canonical(ip)).is_ok()
    }
}

impl FromIterator<IpAddr> for HostAddresses {
    fn from_iter<I: IntoIterator<Item = IpAddr>>(addresses: I) -> HostAddresses {
        let mut all: Vec<IpAddr> = addresses.into_iter().map(canonical).collect();
        all.sort_unstable();
        all.dedup();
        HostAddresses(all.into())
    }
}

/// How long the host's addresses, once read, are used before they are read again.
///
/// Reading them costs a netlink dump of every link and address: 40 us on a host with 4 links, 760 us with 104
/// (measured), which is too much to pay on each connection of a host with many links; once a second it is not.
/// An address the host gains is thus refused within a second.
pub const HOST_ADDRESSES_MAX_AGE: Duration = Duration::from_secs(1);

/// The host's addresses as last read, shared by the clones of a policy (every proxy of a daemon).
#[derive(Debug, Default)]
struct InterfaceCache(Mutex<Option<(Instant, HostAddresses)>>);

impl InterfaceCache {
    /// The addresses read less than [`HOST_ADDRESSES_MAX_AGE`] ago, or read now. One reader at a time: the others
    /// wait for its result.
    fn get(&self) -> io::Result<HostAddresses> {
        let mut cached = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, addresses)) = &*cached {
            if at.elapsed() < HOST_ADDRESSES_MAX_AGE {
                return Ok(addresses.clone());
            }
        }
        let fresh = HostAddresses::read()?;
        *cached = Some((Instant::now(), fresh.clone()));
        Ok(fresh)
    }
}

/// Where a policy takes the host's addresses from.
#[derive(Debug, Clone)]
enum HostSource {
    /// getifaddrs(3), read again once [`HOST_ADDRESSES_MAX_AGE`] old.
    Interfaces(Arc<InterfaceCache>),
    /// A fixed set (tests).
    #[cfg(any(test, feature = "test-exemptions"))]
    Fixed(HostAddresses),
}

impl Default for HostSource {
    fn default() -> HostSource {
        HostSource::Interfaces(Arc::default())
    }
}

/// The address policy: the fixed refusals, the operator's `allow_private` and `allow_networks`, the daemon's listen
/// addresses and the host's own interface addresses.
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    allow_private: bool,
    allow_networks: Vec<IpNet>,
    daemon_addresses: Vec<SocketAddr>,
    host: HostSource,
    #[cfg(any(test, feature = "test-exemptions"))]
    exempt: Vec<SocketAddr>,
}

impl AddressPolicy {
    /// The default policy: every range listed in [`AddressRefusal`] refused, and the host's interface addresses.
    pub fn new() -> AddressPolicy {
        AddressPolicy::default()
    }

    /// Operator opt-in: permit RFC 1918 and ULA destinations. Loopback, link-local, the host's own addresses and
    /// the rest stay refused.
    pub fn allow_private(mut self, allow: bool) -> AddressPolicy {
        self.allow_private = allow;
        self
    }

    /// Operator opt-in: permit the addresses inside these networks that are refused only as private, shared (CGNAT)
    /// or special-purpose (benchmarking 198.18.0.0/15, documentation, ...) addresses. Loopback, link-local,
    /// unspecified, multicast and reserved (broadcast) addresses, the daemon's listen addresses and the host's own
    /// addresses stay refused even inside a listed network. Networks from an operator go through
    /// [`parse_allowed_networks`] first, which refuses one that overlaps a range never permitted.
    pub fn allow_networks(mut self, networks: impl IntoIterator<Item = IpNet>) -> AddressPolicy {
        self.allow_networks.extend(networks);
        self
    }

    /// The daemon's own listen addresses, refused whatever their range. An unspecified IP (`0.0.0.0:7000`) refuses
    /// that port on every address, since any of the host's addresses reaches it.
    pub fn daemon_addresses(
        mut self,
        addresses: impl IntoIterator<Item = SocketAddr>,
    ) -> AddressPolicy {
        self.daemon_addresses.extend(addresses);
        self
    }

    /// Tests only: permit exactly this socket address (a test's own loopback server), nothing else around it.
    /// Exists only with the `test-exemptions` feature, which no production build enables.
    #[cfg(any(test, feature = "test-exemptions"))]
    pub fn exempt_for_tests(mut self, address: SocketAddr) -> AddressPolicy {
        self.exempt.push(address);
        self
    }

    /// Tests only: take these as the host's addresses instead of reading the interfaces'.
    #[cfg(any(test, feature = "test-exemptions"))]
    pub fn host_addresses_for_tests(mut self, addresses: HostAddresses) -> AddressPolicy {
        self.host = HostSource::Fixed(addresses);
        self
    }

    /// The host's addresses, read at most [`HOST_ADDRESSES_MAX_AGE`] ago, to check the addresses of one resolution
    /// against ([`AddressPolicy::check_among`]).
    pub fn host_addresses(&self) -> io::Result<HostAddresses> {
        match &self.host {
            HostSource::Interfaces(cache) => cache.get(),
            #[cfg(any(test, feature = "test-exemptions"))]
            HostSource::Fixed(fixed) => Ok(fixed.clone()),
        }
    }

    /// Whether the proxy may connect to `address`; the refusal reason otherwise.
    pub fn check(&self, address: SocketAddr) -> Result<(), AddressRefusal> {
        self.check_among(address, self.host_addresses().ok().as_ref())
    }

    /// [`AddressPolicy::check`] against the host's addresses `host` (`None`: they could not be read, and every
    /// address the rest of the policy permits is refused).
    pub fn check_among(
        &self,
        address: SocketAddr,
        host: Option<&HostAddresses>,
    ) -> Result<(), AddressRefusal> {
        #[cfg(any(test, feature = "test-exemptions"))]
        if self.exempt.contains(&address) {
            return Ok(());
        }
        let own = self.daemon_addresses.iter().any(|d| {
            d.port() == address.port()
                && (d.ip().is_unspecified() || canonical(d.ip()) == canonical(address.ip()))
        });
        if own {
            return Err(AddressRefusal::DaemonAddress);
        }
        match classify(address.ip()) {
            None => {}
            Some(AddressRefusal::Private) if self.allow_private => {}
            Some(refusal) if refusal.listable() && self.in_allowed_network(address.ip()) => {}
            Some(refusal) => return Err(refusal),
        }
        match host {
            None => Err(AddressRefusal::HostAddressesUnknown),
            Some(host) if host.contains(address.ip()) => Err(AddressRefusal::HostAddress),
            Some(_) => Ok(()),
        }
    }

    /// Whether `ip`, in the form [`classify`] checks, lies in one of the operator's `allow_networks`.
    fn in_allowed_network(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.allow_networks.iter().any(|net| net.contains(&ip))
    }
}

impl AddressRefusal {
    /// Whether an operator's `allow_networks` may permit addresses refused for this reason: the private, shared
    /// and special-purpose ranges may hold a network the operator runs; the others never hold a destination.
    fn listable(self) -> bool {
        matches!(
            self,
            AddressRefusal::Private | AddressRefusal::SharedCgnat | AddressRefusal::SpecialPurpose
        )
    }
}

/// Why an `allow_networks` entry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllowedNetworkError {
    /// Not `address/prefix`.
    #[error("Entry {0:?} is not a network in CIDR notation (such as 198.18.3.0/24)")]
    NotCidr(String),
    /// The address has bits set beyond the prefix (`198.18.3.7/24`), so which network was meant is unclear.
    #[error("Entry {entry} has host bits set (the network would be {network})")]
    HostBits {
        /// The entry.
        entry: IpNet,
        /// The network its prefix makes.
        network: IpNet,
    },
    /// The network overlaps a range whose addresses are never permitted.
    #[error("Entry {entry} overlaps {range} ({reason}), never permitted")]
    NeverPermitted {
        /// The entry.
        entry: IpNet,
        /// The range it overlaps.
        range: IpNet,
        /// The range's refusal.
        reason: AddressRefusal,
    },
    /// An IPv6 network that overlaps a range embedding IPv4 addresses, which are checked as those IPv4 addresses.
    #[error("Entry {entry} overlaps {range}, whose addresses embed IPv4 ones; list the IPv4 network instead")]
    EmbedsIpv4 {
        /// The entry.
        entry: IpNet,
        /// The embedding range.
        range: IpNet,
    },
}

/// The IPv6 ranges whose addresses [`classify`] checks as the IPv4 address they embed (mapped, translated,
/// NAT64 64:ff9b::/96, 6to4; compatible ::/96 overlaps :: and ::1, refused as those).
const V6_EMBEDDING: [Ipv6Net; 4] = [
    Ipv6Net::new_assert(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0), 96),
    Ipv6Net::new_assert(Ipv6Addr::new(0, 0, 0, 0, 0xffff, 0, 0, 0), 96),
    v6(0x64, 0xff9b, 0, 96),
    v6(0x2002, 0, 0, 16),
];

/// Parses the operator's `allow_networks` (CIDR networks such as `198.18.3.0/24` or `fd00:1::/48`) for
/// [`AddressPolicy::allow_networks`]. Each must be a network without host bits that overlaps none of the ranges
/// never permitted (loopback, link-local, unspecified, multicast, reserved and broadcast; for IPv6 also the ranges
/// that embed an IPv4 address: list the IPv4 network instead). The first bad entry is the error.
pub fn parse_allowed_networks<S: AsRef<str>>(
    entries: &[S],
) -> Result<Vec<IpNet>, AllowedNetworkError> {
    entries
        .iter()
        .map(|entry| {
            let entry = entry.as_ref();
            let net: IpNet = entry
                .trim()
                .parse()
                .map_err(|_| AllowedNetworkError::NotCidr(entry.to_owned()))?;
            check_allowed_network(net)?;
            Ok(net)
        })
        .collect()
}

fn check_allowed_network(entry: IpNet) -> Result<(), AllowedNetworkError> {
    if entry.trunc() != entry {
        return Err(AllowedNetworkError::HostBits {
            entry,
            network: entry.trunc(),
        });
    }
    let never = |(range, reason): (IpNet, AddressRefusal)| {
        (!reason.listable() && overlap(entry, range)).then_some(
            AllowedNetworkError::NeverPermitted {
                entry,
                range,
                reason,
            },
        )
    };
    let v4 = V4_RANGES.iter().map(|(n, r)| (IpNet::V4(*n), *r));
    let v6 = V6_RANGES.iter().map(|(n, r)| (IpNet::V6(*n), *r));
    if let Some(refused) = v4.chain(v6).find_map(never) {
        return Err(refused);
    }
    match V6_EMBEDDING
        .iter()
        .find(|range| overlap(entry, IpNet::V6(**range)))
    {
        Some(range) => Err(AllowedNetworkError::EmbedsIpv4 {
            entry,
            range: IpNet::V6(*range),
        }),
        None => Ok(()),
    }
}

/// Whether two networks share an address (networks nest or are disjoint).
fn overlap(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// An IPv6 address that embeds an IPv4 one (mapped, translated ::ffff:0:0:0/96, compatible, NAT64 64:ff9b::/96,
/// 6to4 2002::/16) as that IPv4 address, so each range is checked once.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => embedded_v4(v6).map_or(ip, IpAddr::V4),
    }
}

fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = v6.segments();
    let o = v6.octets();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..6] == [0; 6] && !v6.is_unspecified() && !v6.is_loopback() {
        return Some(tail);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

const fn v4(a: u8, b: u8, c: u8, d: u8, len: u8) -> Ipv4Net {
    Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), len)
}

const fn v6(first: u16, second: u16, third: u16, len: u8) -> Ipv6Net {
    Ipv6Net::new_assert(Ipv6Addr::new(first, second, third, 0, 0, 0, 0, 0), len)
}

/// The IPv4 ranges never connected to (IANA's special-purpose registry, and multicast and class E), with the
/// refusal of each.
const V4_RANGES: [(Ipv4Net, AddressRefusal); 15] = {
    use AddressRefusal::*;
    [
        (v4(0, 0, 0, 0, 8), Unspecified),
        (v4(10, 0, 0, 0, 8), Private),
        (v4(100, 64, 0, 0, 10), SharedCgnat),
        (v4(127, 0, 0, 0, 8), Loopback),
        (v4(169, 254, 0, 0, 16), LinkLocal),
        (v4(172, 16, 0, 0, 12), Private),
        (v4(192, 0, 0, 0, 24), SpecialPurpose),
        (v4(192, 0, 2, 0, 24), SpecialPurpose),
        (v4(192, 88, 99, 0, 24), SpecialPurpose),
        (v4(192, 168, 0, 0, 16), Private),
        (v4(198, 18, 0, 0, 15), SpecialPurpose),
        (v4(198, 51, 100, 0, 24), SpecialPurpose),
        (v4(203, 0, 113, 0, 24), SpecialPurpose),
        (v4(224, 0, 0, 0, 4), Multicast),
        // 240.0.0.0/4 and the limited broadcast 255.255.255.255 in it.
        (v4(240, 0, 0, 0, 4), Reserved),
    ]
};

/// The IPv6 ranges never connected to; those that embed an IPv4 address are checked as that address instead.
const V6_RANGES: [(Ipv6Net, AddressRefusal); 12] = {
    use AddressRefusal::*;
    [
        (v6(0, 0, 0, 128), Unspecified),
        (Ipv6Net::new_assert(Ipv6Addr::LOCALHOST, 128), Loopback),
        (v6(0x64, 0xff9b, 1, 48), SpecialPurpose),
        (v6(0x100, 0, 0, 64), SpecialPurpose),
        (v6(0x2001, 0, 0, 23), SpecialPurpose),
        (v6(0x2001, 0xdb8, 0, 32), SpecialPurpose),
        (v6(0x3fff, 0, 0, 20), SpecialPurpose),
        (v6(0x5f00, 0, 0, 16), SpecialPurpose),
        (v6(0xfc00, 0, 0, 7), Private),
        (v6(0xfe80, 0, 0, 10), LinkLocal),
        (v6(0xfec0, 0, 0, 10), LinkLocal),
        (v6(0xff00, 0, 0, 8), Multicast),
    ]
};

/// The refusal for an address in a special range, `None` for an ordinary one.
pub fn classify(ip: IpAddr) -> Option<AddressRefusal> {
    match canonical(ip) {
        IpAddr::V4(v4) => V4_RANGES
            .iter()
            .find(|(net, _)| net.contains(&v4))
            .map(|(_, refusal)| *refusal),
        IpAddr::V6(v6) => V6_RANGES
            .iter()
            .find(|(net, _)| net.contains(&v6))
            .map(|(_, refusal)| *refusal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 443)
    }

    /// The default policy on a host without addresses of its own, so the host running the test does not matter.
    fn policy() -> AddressPolicy {
        AddressPolicy::new().host_addresses_for_tests(HostAddresses::default())
    }

    #[test]
    fn special_ranges_are_refused_in_every_form() {
        use AddressRefusal::*;
        let policy = policy();
        let cases = [
            ("127.0.0.1", Loopback),
            ("127.255.0.9", Loopback),
            ("::1", Loopback),
            ("::ffff:127.0.0.1", Loopback),
            ("::127.0.0.1", Loopback),
            ("10.1.2.3", Private),
            ("172.16.0.1", Private),
            ("172.31.255.255", Private),
            ("192.168.1.1", Private),
            ("::ffff:10.0.0.1", Private),
            ("64:ff9b::a00:1", Private),
            ("2002:c0a8:0101::1", Private),
            ("fc00::1", Private),
            ("fd12:3456::1", Private),
            ("169.254.169.254", LinkLocal),
            ("::ffff:169.254.169.254", LinkLocal),
            ("fe80::1", LinkLocal),
            ("febf::1", LinkLocal),
            ("100.64.0.1", SharedCgnat),
            ("100.127.255.255", SharedCgnat),
            ("224.0.0.1", Multicast),
            ("ff02::1", Multicast),
            ("::ffff:224.0.0.1", Multicast),
            ("0.0.0.0", Unspecified),
            ("0.1.2.3", Unspecified),
            ("::", Unspecified),
            ("::ffff:0.0.0.0", Unspecified),
            ("255.255.255.255", Reserved),
            ("240.0.0.1", Reserved),
        ];
        for (ip, want) in cases {
            assert_eq!(policy.check(at(ip)), Err(want), "{ip}");
        }
        for ip in [
            "93.184.216.34",
            "100.128.0.1",
            "172.32.0.1",
            "2606:4700::1",
            "::ffff:93.184.216.34",
        ] {
            assert_eq!(policy.check(at(ip)), Ok(()), "{ip}");
        }
    }

    #[test]
    fn allow_private_permits_only_private_ranges() {
        let policy = policy().allow_private(true);
        for ip in ["10.1.2.3", "192.168.0.1", "fd00::1", "::ffff:172.16.0.1"] {
            assert_eq!(policy.check(at(ip)), Ok(()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "::1",
            "169.254.169.254",
            "fe80::1",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
        ] {
            assert!(policy.check(at(ip)).is_err(), "{ip}");
        }
    }

    #[test]
    fn daemon_addresses_are_refused() {
        let policy = policy().allow_private(true).daemon_addresses([
            "10.0.0.5:7000".parse().unwrap(),
            "0.0.0.0:7001".parse().unwrap(),
        ]);
        let refused = [
            "10.0.0.5:7000",
            "[::ffff:10.0.0.5]:7000",
            "93.184.216.34:7001",
            "10.9.9.9:7001",
        ];
        for a in refused {
            assert_eq!(
                policy.check(a.parse().unwrap()),
                Err(AddressRefusal::DaemonAddress),
                "{a}"
            );
        }
        assert_eq!(policy.check("10.0.0.5:7002".parse().unwrap()), Ok(()));
    }

    #[test]
    fn special_purpose_ranges_are_refused_in_every_form() {
        let policy = policy().allow_private(true);
        let refused = [
            "192.0.0.1",
            "192.0.0.255",
            "192.0.2.1",
            "198.18.0.1",
            "198.19.255.255",
            "198.51.100.7",
            "203.0.113.9",
            "192.88.99.1",
            "::ffff:198.18.0.1",
            "::ffff:0:192.0.2.1",
            "64:ff9b::c000:201",
            "2002:c612:1::1",
            "64:ff9b:1::1",
            "64:ff9b:1:ffff::1",
            "100::1",
            "2001::1",
            "2001:2::1",
            "2001:1ff::1",
            "2001:db8::1",
            "3fff::1",
            "5f00::1",
        ];
        for ip in refused {
            assert_eq!(
                policy.check(at(ip)),
                Err(AddressRefusal::SpecialPurpose),
                "{ip}"
            );
        }
        // Their neighbours are ordinary addresses.
        for ip in [
            "192.0.1.255",
            "192.0.3.0",
            "198.17.255.255",
            "198.20.0.0",
            "198.51.101.0",
            "203.0.114.0",
            "64:ff9b:2::1",
            "2001:200::1",
            "2001:db9::1",
        ] {
            assert_eq!(policy.check(at(ip)), Ok(()), "{ip}");
        }
    }

    #[test]
    fn the_hosts_own_addresses_are_refused_on_every_port_and_in_every_form() {
        let host: HostAddresses = ["93.184.216.34", "2606:4700::1234", "10.0.0.7"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        let policy = AddressPolicy::new()
            .allow_private(true)
            .host_addresses_for_tests(host);
        for a in [
            "93.184.216.34:443",
            "93.184.216.34:22",
            "[::ffff:93.184.216.34]:8080",
            "[64:ff9b::5db8:d822]:443",
            "[2606:4700::1234]:443",
            "10.0.0.7:80",
        ] {
            assert_eq!(
                policy.check(a.parse().unwrap()),
                Err(AddressRefusal::HostAddress),
                "{a}"
            );
        }
        for a in ["93.184.216.35:443", "[2606:4700::1235]:443", "10.0.0.8:80"] {
            assert_eq!(policy.check(a.parse().unwrap()), Ok(()), "{a}");
        }
        // Addresses that could not be read refuse everything the ranges permit; a range's refusal stays the reason.
        assert_eq!(
            policy.check_among(at("93.184.216.35"), None),
            Err(AddressRefusal::HostAddressesUnknown)
        );
        assert_eq!(
            policy.check_among(at("127.0.0.1"), None),
            Err(AddressRefusal::Loopback)
        );
    }

    /// The real interfaces: loopback is among them, and none of their addresses is permitted, private ones
    /// included with `allow_private` (the host this runs on has at least `lo`; CI's also an `eth0`).
    #[test]
    fn every_interface_address_of_this_host_is_refused() {
        let host = HostAddresses::read().unwrap();
        assert!(host.contains(IpAddr::V4(Ipv4Addr::LOCALHOST)), "{host:?}");
        let policy = AddressPolicy::new().allow_private(true);
        for &ip in host.0.iter() {
            for port in [443, 7000] {
                let refused = policy.check(SocketAddr::new(ip, port));
                assert!(refused.is_err(), "{ip}:{port} permitted");
                if classify(ip).is_none_or(|r| r == AddressRefusal::Private) {
                    assert_eq!(refused, Err(AddressRefusal::HostAddress), "{ip}:{port}");
                }
            }
        }
    }

    fn nets(entries: &[&str]) -> Vec<IpNet> {
        entries.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn allowed_networks_permit_only_addresses_inside_them() {
        use AddressRefusal::*;
        let policy = policy().allow_networks(nets(&[
            "198.18.3.0/24",
            "10.20.0.0/16",
            "100.64.1.0/24",
            "192.0.2.0/28",
            "2001:db8:1::/48",
            "fd00:1::/32",
        ]));
        for ip in [
            "198.18.3.0",
            "198.18.3.2",
            "198.18.3.255",
            "::ffff:198.18.3.2",
            "64:ff9b::c612:302",
            "10.20.255.1",
            "100.64.1.9",
            "192.0.2.15",
            "2001:db8:1:ffff::1",
            "fd00:1::7",
            "93.184.216.34",
        ] {
            assert_eq!(policy.check(at(ip)), Ok(()), "{ip}");
        }
        for (ip, want) in [
            ("198.18.2.255", SpecialPurpose),
            ("198.18.4.0", SpecialPurpose),
            ("198.19.3.2", SpecialPurpose),
            ("10.21.0.1", Private),
            ("10.1.2.3", Private),
            ("192.168.1.1", Private),
            ("100.64.2.1", SharedCgnat),
            ("192.0.2.16", SpecialPurpose),
            ("2001:db8:2::1", SpecialPurpose),
            ("fd00:2::1", Private),
            ("127.0.0.1", Loopback),
            ("169.254.169.254", LinkLocal),
        ] {
            assert_eq!(policy.check(at(ip)), Err(want), "{ip}");
        }
        // allow_private still permits every private address; the networks add to it.
        let both = policy.clone().allow_private(true);
        assert_eq!(both.check(at("192.168.1.1")), Ok(()));
        assert_eq!(both.check(at("198.18.4.0")), Err(SpecialPurpose));
    }

    /// Even networks that `parse_allowed_networks` would refuse, given to the builder directly, permit nothing
    /// beyond the listable refusals: the host's and the daemon's addresses and the fixed ranges stay refused.
    #[test]
    fn allowed_networks_never_permit_the_hosts_addresses_or_loopback() {
        use AddressRefusal::*;
        let host: HostAddresses = ["198.18.3.1", "fd00:1::1"]
            .iter()
            .map(|ip| ip.parse().unwrap())
            .collect();
        let policy = AddressPolicy::new()
            .host_addresses_for_tests(host)
            .daemon_addresses(["198.18.3.2:7000".parse().unwrap()])
            .allow_networks(nets(&["198.18.3.0/24", "fd00:1::/32", "0.0.0.0/0", "::/0"]));
        for (a, want) in [
            ("198.18.3.1:443", HostAddress),
            ("198.18.3.1:22", HostAddress),
            ("[::ffff:198.18.3.1]:443", HostAddress),
            ("[fd00:1::1]:443", HostAddress),
            ("198.18.3.2:7000", DaemonAddress),
            ("127.0.0.1:443", Loopback),
            ("[::1]:443", Loopback),
            ("[::ffff:127.0.0.1]:443", Loopback),
            ("169.254.169.254:80", LinkLocal),
            ("[fe80::1]:443", LinkLocal),
            ("0.0.0.0:443", Unspecified),
            ("[::]:443", Unspecified),
            ("224.0.0.1:443", Multicast),
            ("[ff02::1]:443", Multicast),
            ("255.255.255.255:443", Reserved),
        ] {
            assert_eq!(policy.check(a.parse().unwrap()), Err(want), "{a}");
        }
        assert_eq!(policy.check("198.18.3.2:443".parse().unwrap()), Ok(()));
        assert_eq!(
            policy.check_among(at("198.18.3.2"), None),
            Err(HostAddressesUnknown)
        );
    }

    /// The real interfaces, each address's own network listed: still refused as the host's.
    #[test]
    fn every_interface_address_of_this_host_is_refused_inside_allowed_networks() {
        let host = HostAddresses::read().unwrap();
        let listed = host.iter().map(IpNet::from);
        let policy = AddressPolicy::new().allow_networks(listed);
        for ip in host.iter() {
            let refused = policy.check(SocketAddr::new(ip, 443));
            assert!(refused.is_err(), "{ip} permitted");
            if classify(ip).is_none_or(AddressRefusal::listable) {
                assert_eq!(refused, Err(AddressRefusal::HostAddress), "{ip}");
            }
        }
    }

    #[test]
    fn allowed_networks_are_checked_when_parsed() {
        let good = [
            "198.18.3.0/24",
            " 10.20.0.0/16 ",
            "100.64.0.0/10",
            "192.168.0.0/16",
            "8.8.8.0/24",
            "2001:db8:1::/48",
            "fd00::/8",
            "64:ff9b:1::/48",
        ];
        assert_eq!(parse_allowed_networks(&good).unwrap().len(), good.len());
        assert_eq!(parse_allowed_networks::<&str>(&[]), Ok(Vec::new()));
        for (entry, want) in [
            ("nope", "not a network in CIDR notation"),
            ("198.18.3.7", "not a network in CIDR notation"),
            ("198.18.3.0/33", "not a network in CIDR notation"),
            (
                "198.18.3.7/24",
                "host bits set (the network would be 198.18.3.0/24)",
            ),
            ("0.0.0.0/0", "overlaps 0.0.0.0/8 (unspecified address)"),
            ("0.0.0.0/8", "overlaps 0.0.0.0/8 (unspecified address)"),
            ("127.0.0.0/8", "overlaps 127.0.0.0/8 (loopback address)"),
            ("127.0.0.1/32", "overlaps 127.0.0.0/8 (loopback address)"),
            ("126.0.0.0/7", "overlaps 127.0.0.0/8 (loopback address)"),
            (
                "169.254.169.254/32",
                "overlaps 169.254.0.0/16 (link-local address)",
            ),
            (
                "169.0.0.0/8",
                "overlaps 169.254.0.0/16 (link-local address)",
            ),
            ("224.0.0.0/8", "overlaps 224.0.0.0/4 (multicast address)"),
            ("192.0.0.0/2", "overlaps 224.0.0.0/4 (multicast address)"),
            (
                "255.255.255.255/32",
                "overlaps 240.0.0.0/4 (reserved address)",
            ),
            ("::/0", "overlaps ::/128 (unspecified address)"),
            ("::1/128", "overlaps ::1/128 (loopback address)"),
            ("fe80::/64", "overlaps fe80::/10 (link-local address)"),
            ("ff02::/16", "overlaps ff00::/8 (multicast address)"),
            (
                "::ffff:0:0/96",
                "overlaps ::ffff:0.0.0.0/96, whose addresses embed IPv4",
            ),
            ("::ffff:198.18.3.0/120", "whose addresses embed IPv4"),
            (
                "64:ff9b::/96",
                "overlaps 64:ff9b::/96, whose addresses embed IPv4",
            ),
            (
                "2002::/16",
                "overlaps 2002::/16, whose addresses embed IPv4",
            ),
            ("2000::/3", "overlaps 2002::/16, whose addresses embed IPv4"),
        ] {
            let e = parse_allowed_networks(&["198.18.3.0/24", entry]).unwrap_err();
            assert!(e.to_string().contains(want), "{entry}: {e}");
        }
    }

    #[test]
    fn a_test_exemption_permits_exactly_one_address() {
        let server: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let policy = AddressPolicy::new().exempt_for_tests(server);
        assert_eq!(policy.check(server), Ok(()));
        assert_eq!(
            policy.check("127.0.0.1:4001".parse().unwrap()),
            Err(AddressRefusal::Loopback)
        );
        assert_eq!(
            policy.check("127.0.0.2:4000".parse().unwrap()),
            Err(AddressRefusal::Loopback)
        );
        assert_eq!(
            AddressPolicy::new().check(server),
            Err(AddressRefusal::Loopback)
        );
    }
}
