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

/// Pod `name`'s certificate for `ip` (its DNS name and its address), signed by the
/// authority `ca`: the `[cluster]` keys.
fn pod_cert(dir: &Path, ca: &str, trust: &str, name: &str, ip: &str) -> String {
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName=DNS:{name},IP:{ip}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"),
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

/// Whether `openssl` (Debian's package, which .ci/run installs) is there to make the
/// certificates: a tool under the skip policy like the others.
fn have_openssl(test: &str) -> bool {
    let found = Command::new("openssl")
        .arg("version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        denoised_runtime::skip::skip(
            test,
            denoised_runtime::skip::Need::Tool,
            "no `openssl` on the PATH",
        );
    }
    found
}

#[test]
fn pods_speak_tls_and_refuse_a_certificate_the_cluster_ca_did_not_sign() {
    if !have_openssl("pods_speak_tls_and_refuse_a_certificate_the_cluster_ca_did_not_sign") {
        return;
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

/// With TLS a pod's name comes from its certificate: a pod whose certificate does not
/// name it does not start, and one that starts anyway (a fault lets it: an impostor
/// with a certificate the cluster CA signed for another name) and says it is pod a is
/// refused by its peers, which keep routing a's work to the real a.
#[test]
fn a_pod_is_the_pod_its_certificate_names() {
    if !have_openssl("a_pod_is_the_pod_its_certificate_names") {
        return;
    }
    let _one = one_cluster_at_a_time();
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    ca(dir, "cluster");
    let mut a = Pod::new("a", "127.0.0.2");
    let mut b = Pod::new("b", "127.0.0.3");
    // Says it is a, with the certificate of pod m.
    let mut m = Pod::new("a", "127.0.0.5");
    let all = [a.addr(), b.addr(), m.addr()];
    let m_keys = pod_cert(dir, "cluster", "cluster", "m", "127.0.0.5");

    // Without the fault it refuses to start, and says why.
    let config = m.config(&all, COOKIE, &m_keys);
    let out = Command::new(env!("CARGO_BIN_EXE_denoised"))
        .args(["serve", "--listen", "127.0.0.5:0", "--config"])
        .arg(&config)
        .env("DENOISED_CACHE_DIR", m.dir.path().join("cache"))
        .env("RUNTIME_DIRECTORY", m.dir.path())
        .env("DENOISED_FAULT", "")
        .stdout(std::process::Stdio::null())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("does not name this pod"), "{said}");

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
    m.fault = Some("router:claim_any_name".into());
    m.start_with(&all, COOKIE, &m_keys);
    a.wait_for("b up", Duration::from_secs(20), |v| up(v, "b"));
    b.wait_for("a up", Duration::from_secs(20), |v| up(v, "a"));
    a.d().template("room", 4);
    b.wait_for("a's template", Duration::from_secs(10), |v| {
        v.iter().any(|p| p.0 == "a" && p.2 == 1)
    });
    // The impostor beats each second; its peers refuse each beat and its report.
    let t0 = Instant::now();
    while !b.log_text().contains("says it is pod \"a\"")
        && !b.log_text().contains("says it is from pod \"a\"")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "b logged no refusal:\n{}",
            b.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        // "a" in b's view is still the real a: up, with its template.
        let (_, v) = b.d().get("/readyz");
        let pods = v["pods"].as_array().unwrap();
        let named_a: Vec<_> = pods.iter().filter(|p| p["pod"] == "a").collect();
        assert_eq!(named_a.len(), 1, "{v}");
        assert_eq!(
            named_a[0]["http"],
            a.d().url.trim_start_matches("http://"),
            "{v}"
        );
        assert_eq!(named_a[0]["templates"], 1, "{v}");
        let (s, e) = b.d().post("/v1/edits", &edit_body("room", 5));
        assert_eq!((s, e["pod"].as_str()), (200, Some("a")), "{e}");
    }
    // The impostor is in no pod's view.
    let seen: Vec<String> = a.peers().into_iter().map(|p| p.0).collect();
    assert_eq!(seen, ["b"]);
}
