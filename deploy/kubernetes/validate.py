#!/usr/bin/env python3
"""Offline check of the Kubernetes manifests in this directory (.ci/run runs it).

    PYTHONPATH=target/kubernetes-validate python3 deploy/kubernetes/validate.py \
        --kubernetes-version 1.33.0 [DIR]

Needs kubernetes-validate (PyPI) on the path: it bundles the JSON schemas of the
Kubernetes releases it knows and brings jsonschema and PyYAML, so nothing is fetched.

- Every object of every *.yaml manifest, strictly against that release's schema (an
  unknown field fails). A kind it has no schema for fails too, except a PodMonitor,
  checked against schemas/podmonitor-monitoring-v1.json (from prometheus-operator's CRD).
- kustomization.yaml lists exactly the manifests of the directory.
- prometheus-scrape.yml against schemas/prometheus-scrape.json.
- The ConfigMap's config.toml parses, and agrees with the other objects: the peers'
  headless Service, namespace and port; the GPU count; the /dev/shm size against the
  arenas; the grace period against the worst-case stop; the registry against etcd.yaml.

DIR (default: this script's directory) holds the manifests; the schemas are always
this directory's. Prints one line per check and exits 1 if any failed.
"""

import argparse
import json
import pathlib
import re
import sys
import tomllib

import jsonschema
import yaml
from kubernetes_validate import utils as kv

HERE = pathlib.Path(__file__).resolve().parent
KUSTOMIZATION = "kustomization.yaml"
SCRAPE = "prometheus-scrape.yml"
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json"}

errors = []


def fail(msg):
    errors.append(msg)
    print(f"ERROR {msg}")


def schema(name):
    return json.loads((HERE / "schemas" / name).read_text())


def check_schema(what, data, name):
    validator = jsonschema.Draft7Validator(schema(name))
    errs = sorted(validator.iter_errors(data), key=lambda e: list(e.path))
    for e in errs:
        fail(f"{what}: {'.'.join(map(str, e.path)) or '(top)'}: {e.message}")
    if not errs:
        print(f"ok    {what} (schemas/{name})")


def quantity(q):
    """A Kubernetes quantity in bytes (binary and decimal suffixes)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    if not m:
        raise ValueError(f"quantity {q!r}")
    mult = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    return int(m.group(1)) * mult


def consistency(objs, namespace):
    """The config against the objects that must agree with it."""
    before = len(errors)
    cm = objs[("ConfigMap", "denoised-config")]
    sts = objs[("StatefulSet", "denoised")]
    peers = objs[("Service", "denoised-peers")]
    try:
        cfg = tomllib.loads(cm["data"]["config.toml"])
    except tomllib.TOMLDecodeError as e:
        fail(f"configmap config.toml: {e}")
        return
    pod = sts["spec"]["template"]["spec"]
    (ctr,) = [c for c in pod["containers"] if c["name"] == "denoised"]
    cluster, workers = cfg.get("cluster", {}), cfg.get("workers", {})
    want = f"dns:{peers['metadata']['name']}.{namespace}.svc.cluster.local:"
    for p in cluster.get("peers", []):
        if not p.startswith(want):
            fail(f"[cluster] peers {p!r}: not the headless Service in namespace {namespace!r} ({want}PORT)")
        elif int(p.rsplit(":", 1)[1]) not in [x["port"] for x in peers["spec"]["ports"]]:
            fail(f"[cluster] peers {p!r}: not a port of Service {peers['metadata']['name']}")
    if sts["spec"]["serviceName"] != peers["metadata"]["name"]:
        fail("StatefulSet serviceName is not the headless Service")
    listen_port = int(cluster.get("listen", ":0").rsplit(":", 1)[1])
    if listen_port not in [p["containerPort"] for p in ctr["ports"] if p["name"] == "cluster"]:
        fail(f"[cluster] listen port {listen_port} is not the container's port 'cluster'")
    gpus = len(cfg["device"]["device"].removeprefix("cuda:").split(","))
    if int(ctr["resources"]["limits"].get("nvidia.com/gpu", 0)) != gpus:
        fail(f"nvidia.com/gpu limit is not the {gpus} GPU(s) of [device] device")
    # Arenas: router, preprocess and postprocess of arena_bytes, one denoise worker per
    # GPU of denoise_arena_bytes, the cache's cache_arena_bytes (defaults: config.toml).
    arenas = (workers.get("arena_bytes", 2**28)
              * (1 + workers.get("preprocess", 1) + workers.get("postprocess", 1))
              + gpus * workers.get("denoise_arena_bytes", 2**30)
              + workers.get("cache_arena_bytes", 2**30))
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    if shm["emptyDir"].get("medium") != "Memory" or quantity(shm["emptyDir"]["sizeLimit"]) < arenas:
        fail(f"/dev/shm: a Memory emptyDir of at least the arenas' {arenas} bytes")
    if quantity(ctr["resources"]["limits"]["memory"]) <= quantity(shm["emptyDir"]["sizeLimit"]):
        fail("the memory limit must exceed /dev/shm's sizeLimit (the arenas count as memory)")
    # The worst-case stop (actors/src/supervisor.rs): the preStop pause, the router's
    # drain and 5 s to exit, then five more roles stopped in turn, 10 s each at most.
    drain = cfg.get("server", {}).get("drain_timeout_seconds", 60)
    pre_stop = ctr.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    worst = pre_stop + drain + 5 + 5 * 10
    if pod.get("terminationGracePeriodSeconds", 30) <= worst:
        fail(f"terminationGracePeriodSeconds must exceed the worst-case stop ({worst} s: "
             f"preStop {pre_stop} + drain {drain} + 5 + 5 x 10)")
    # The registry: the etcd members etcd.yaml runs, at their client port.
    etcd = objs.get(("Service", "denoised-etcd"))
    etcd_sts = objs.get(("StatefulSet", "denoised-etcd"))
    if etcd and etcd_sts:
        port = [p["port"] for p in etcd["spec"]["ports"] if p["name"] == "client"][0]
        want = [f"denoised-etcd-{i}.denoised-etcd.{namespace}.svc.cluster.local:{port}"
                for i in range(etcd_sts["spec"]["replicas"])]
        if cluster.get("registry") != want:
            fail(f"[cluster] registry {cluster.get('registry')!r}: not etcd.yaml's members {want!r}")
    for key in ("tls_ca", "tls_cert", "tls_key"):
        if cluster.get(key) and not cluster[key].startswith("/etc/denoised/tls/"):
            fail(f"[cluster] {key} is not in the mounted Secret (/etc/denoised/tls/)")
    if len(errors) == before:
        print("ok    config.toml agrees with the StatefulSet and the Services")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kubernetes-version", required=True)
    ap.add_argument("dir", nargs="?", default=str(HERE))
    args = ap.parse_args()
    d = pathlib.Path(args.dir)

    kust = yaml.safe_load((d / KUSTOMIZATION).read_text())
    allowed = {"apiVersion", "kind", "namespace", "resources", "images"}
    if (kust.get("apiVersion"), kust.get("kind")) != ("kustomize.config.k8s.io/v1beta1", "Kustomization") \
            or set(kust) - allowed:
        fail(f"{KUSTOMIZATION}: a kustomize.config.k8s.io/v1beta1 Kustomization of {sorted(allowed)}")
    listed = set(kust.get("resources", []))
    present = {p.name for p in d.glob("*.yaml")} - {KUSTOMIZATION}
    if listed != present:
        fail(f"{KUSTOMIZATION}: resources {sorted(listed)} are not the manifests {sorted(present)}")
    else:
        print(f"ok    {KUSTOMIZATION} lists the {len(present)} manifests")

    objs = {}
    for name in sorted(present):
        for obj in yaml.safe_load_all((d / name).read_text()):
            if not obj:
                continue
            what = f"{name}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
            objs[(obj.get("kind"), obj.get("metadata", {}).get("name"))] = obj
            crd = CRD_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
            if crd:
                check_schema(what, obj, crd)
                continue
            try:
                v = kv.validate(obj, args.kubernetes_version, strict=True)
                print(f"ok    {what} (Kubernetes {v}, strict)")
            except kv.ValidationError as e:
                fail(f"{what}: {'.'.join(map(str, e.path)) or '(top)'}: {e.message}")
            except (kv.SchemaNotFoundError, kv.VersionNotSupportedError, kv.InvalidSchemaError) as e:
                fail(f"{what}: {e.message}")

    check_schema(SCRAPE, yaml.safe_load((d / SCRAPE).read_text()), "prometheus-scrape.json")
    try:
        consistency(objs, kust.get("namespace", "default"))
    except (KeyError, ValueError) as e:
        fail(f"consistency: missing or malformed {e}")

    print(f"{d}: {len(errors)} error(s)" if errors else f"{d}: ok")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
