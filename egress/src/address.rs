//! Which resolved addresses the proxy may connect to, whatever the allowlist says.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Why an address is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressRefusal {
    /// 127.0.0.0/8, ::1.
    Loopback,
    /// RFC 1918 and ULA fc00::/7 (allowed with `allow_private`).
    Private,
    /// 169.254.0.0/16 (cloud metadata), fe80::/10, and the deprecated site-local fec0::/10.
    LinkLocal,
    /// Shared address space 100.64.0.0/10.
    SharedCgnat,
    /// Multicast.
    Multicast,
    /// 0.0.0.0/8, ::.
    Unspecified,
    /// 255.255.255.255 and 240.0.0.0/4.
    Reserved,
    /// One of the daemon's own listen addresses.
    DaemonAddress,
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
            AddressRefusal::DaemonAddress => "the daemon's own address",
        })
    }
}

/// The address policy: the fixed refusals, the operator's `allow_private`, and the daemon's listen addresses.
#[derive(Debug, Clone, Default)]
pub struct AddressPolicy {
    allow_private: bool,
    daemon_addresses: Vec<SocketAddr>,
    #[cfg(any(test, feature = "test-exemptions"))]
    exempt: Vec<SocketAddr>,
}

impl AddressPolicy {
    /// The default policy: every range listed in [`AddressRefusal`] refused.
    pub fn new() -> AddressPolicy {
        AddressPolicy::default()
    }

    /// Operator opt-in: permit RFC 1918 and ULA destinations. Loopback, link-local and the rest stay refused.
    pub fn allow_private(mut self, allow: bool) -> AddressPolicy {
        self.allow_private = allow;
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

    /// Whether the proxy may connect to `address`; the refusal reason otherwise.
    pub fn check(&self, address: SocketAddr) -> Result<(), AddressRefusal> {
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
            None => Ok(()),
            Some(AddressRefusal::Private) if self.allow_private => Ok(()),
            Some(refusal) => Err(refusal),
        }
    }
}

/// An IPv6 address that embeds an IPv4 one (mapped, compatible, NAT64 64:ff9b::/96, 6to4 2002::/16) as that IPv4
/// address, so each range is checked once.
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
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(tail);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    None
}

/// The refusal for an address in a special range, `None` for an ordinary one.
pub fn classify(ip: IpAddr) -> Option<AddressRefusal> {
    match canonical(ip) {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

fn classify_v4(ip: Ipv4Addr) -> Option<AddressRefusal> {
    let o = ip.octets();
    if ip.is_loopback() {
        Some(AddressRefusal::Loopback)
    } else if o[0] == 0 {
        Some(AddressRefusal::Unspecified)
    } else if ip.is_private() {
        Some(AddressRefusal::Private)
    } else if ip.is_link_local() {
        Some(AddressRefusal::LinkLocal)
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some(AddressRefusal::SharedCgnat)
    } else if ip.is_multicast() {
        Some(AddressRefusal::Multicast)
    } else if ip.is_broadcast() || o[0] >= 240 {
        Some(AddressRefusal::Reserved)
    } else {
        None
    }
}

fn classify_v6(ip: Ipv6Addr) -> Option<AddressRefusal> {
    let first = ip.segments()[0];
    if ip.is_loopback() {
        Some(AddressRefusal::Loopback)
    } else if ip.is_unspecified() {
        Some(AddressRefusal::Unspecified)
    } else if (first & 0xfe00) == 0xfc00 {
        Some(AddressRefusal::Private)
    } else if (first & 0xffc0) == 0xfe80 || (first & 0xffc0) == 0xfec0 {
        Some(AddressRefusal::LinkLocal)
    } else if ip.is_multicast() {
        Some(AddressRefusal::Multicast)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 443)
    }

    #[test]
    fn special_ranges_are_refused_in_every_form() {
        use AddressRefusal::*;
        let policy = AddressPolicy::new();
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
        let policy = AddressPolicy::new().allow_private(true);
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
        let policy = AddressPolicy::new().allow_private(true).daemon_addresses([
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
