//! Security between pods (docs/cluster.md): the cluster cookie and TLS with the
//! cluster's CA, on pods of this machine (tests/common/pods.rs). Each test stops every
//! daemon it starts.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::pods::*;

#[test]
fn a_pod_with_another_cookie_is_refused() {
    let _one = one_cluster_at_a_time();
    let mut a = Pod::new("a", "127.0.0.2");
    let mut d = Pod::new("d", "127.0.0.5");
    a.start(&[a.addr(), d.addr()], COOKIE);
    d.start(&[a.addr()], "not-the-cluster-cookie");
    std::thread::sleep(Duration::from_secs(4));
    assert!(a.peers().iter().all(|p| p.0 != "d"), "{:?}", a.peers());
    assert!(d.peers().is_empty(), "{:?}", d.peers());
    let said = |p: &Pod, needle: &str| {
        let t0 = Instant::now();
        while !p.log_text().contains(needle) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{}: no {needle:?} in:\n{}",
                p.name,
                p.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    said(&a, "refused the peer at");
    said(&d, "refused this pod");
}

fn openssl(dir: &Path, args: &[&str]) {
    let s = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(s.success(), "openssl {args:?}");
}

/// A certificate authority `NAME.crt`/`NAME.key` in `dir`.
fn ca(dir: &Path, name: &str) {
    let (key, crt, subj) = (
        format!("{name}.key"),
        format!("{name}.crt"),
        format!("/CN={name}"),
    );
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &subj,
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign",
        ],
    );
}

/// A pod's certificate for `ip`, signed by the authority `ca`: the `[cluster]` keys.
fn pod_cert(dir: &Path, ca: &str, trust: &str, name: &str, ip: &str) -> String {
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    let (key, csr, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.crt"),
    );
    let subj = format!("/CN={name}");
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &subj,
        ],
    );
    let (ca_crt, ca_key) = (format!("{ca}.crt"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            ext.to_str().unwrap(),
        ],
    );
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    format!(
        "tls_ca = {:?}\ntls_cert = {:?}\ntls_key = {:?}\n",
        p(&format!("{trust}.crt")),
        p(&crt),
        p(&key)
    )
}

#[test]
fn pods_speak_tls_and_refuse_a_certificate_the_cluster_ca_did_not_sign() {
    // openssl (Debian's package, which .ci/run installs) makes the certificates: a tool
    // under the skip policy like the others.
    let found = Command::new("openssl")
        .arg("version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        return denoised_runtime::skip::skip(
            "pods_speak_tls_and_refuse_a_certificate_the_cluster_ca_did_not_sign",
            denoised_runtime::skip::Need::Tool,
            "no `openssl` on the PATH",
        );
    }
    let _one = one_cluster_at_a_time();
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    ca(dir, "cluster");
    ca(dir, "rogue");
    let mut a = Pod::new("a", "127.0.0.2");
    let mut b = Pod::new("b", "127.0.0.3");
    let mut d = Pod::new("d", "127.0.0.5");
    let all = [a.addr(), b.addr(), d.addr()];
    a.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "cluster", "cluster", "a", "127.0.0.2"),
    );
    b.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "cluster", "cluster", "b", "127.0.0.3"),
    );
    // The right cookie and the cluster's CA as its trust, but a certificate the rogue
    // authority signed.
    d.start_with(
        &all,
        COOKIE,
        &pod_cert(dir, "rogue", "cluster", "d", "127.0.0.5"),
    );
    a.wait_for("b up", Duration::from_secs(20), |v| up(v, "b"));
    b.wait_for("a up", Duration::from_secs(20), |v| up(v, "a"));
    a.d().template("room", 4);
    b.wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    let (s, v) = b.d().post("/v1/edits", &edit_body("room", 5));
    assert_eq!((s, v["pod"].as_str()), (200, Some("a")), "{v}");
    std::thread::sleep(Duration::from_secs(2));
    for p in [&a, &b] {
        assert!(p.peers().iter().all(|x| x.0 != "d"), "{:?}", p.peers());
    }
    assert!(d.peers().is_empty(), "{:?}", d.peers());
    let t0 = Instant::now();
    while !a.log_text().contains("refused a peer's certificate") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "a logged no refusal:\n{}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        d.log_text().contains("refused this pod"),
        "{}",
        d.log_text()
    );
}
