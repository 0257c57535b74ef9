//! The systemd notification protocol (sd_notify): `READY=1` once the daemon serves,
//! `STOPPING=1` when it shuts down, `STATUS=` lines for `systemctl status`. A datagram
//! to the socket named by `$NOTIFY_SOCKET`; without it (not under systemd) nothing
//! happens. The router sends READY (it knows when every worker group is up), so the
//! unit sets `NotifyAccess=all`.

use std::os::unix::net::UnixDatagram;

/// Sends one notification; returns whether a socket was there to receive it.
pub fn notify(state: &str) -> bool {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let Ok(sock) = UnixDatagram::unbound() else {
        return false;
    };
    let bytes = path.as_encoded_bytes();
    let sent = if let Some(name) = bytes.strip_prefix(b"@") {
        // An abstract socket: Linux names it with a leading NUL.
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name)
            .and_then(|a| sock.send_to_addr(state.as_bytes(), &a))
    } else {
        sock.send_to(state.as_bytes(), &path)
    };
    if let Err(e) = &sent {
        tracing::warn!("sd_notify: {e}");
    }
    sent.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let rx = UnixDatagram::bind(&path).unwrap();
        // The only test that touches NOTIFY_SOCKET.
        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(notify("READY=1\nSTATUS=test"));
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=test");
        assert!(!notify("READY=1"));
    }
}
