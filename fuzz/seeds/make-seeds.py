#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into fuzz/seeds/<target>/ (run from anywhere;
the seeds are committed, this script says how they were made). Needs python3 and zstd."""
import gzip
import io
import json
import os
import struct
import subprocess
import tarfile

here = os.path.dirname(os.path.abspath(__file__))
repo = os.path.dirname(os.path.dirname(here))
SEP = b"%KILN-NEXT-LAYER%"  # fuzz_targets/layers.rs
# End archives after their two zero blocks, without padding to 10 KiB records.
tarfile.RECORDSIZE = tarfile.BLOCKSIZE


def put(target, name, data):
    d = os.path.join(here, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- front ends: the golden corpus of kiln-recipes --------------------------------------
import glob

for f in sorted(glob.glob(os.path.join(repo, "recipes/tests/cases*/*/Dockerfile")))[:40]:
    case = os.path.basename(os.path.dirname(f))
    put("dockerfile", case, b"\0" + open(f, "rb").read())
for f in sorted(glob.glob(os.path.join(repo, "recipes/tests/cases*/*/*.yaml")))[:40]:
    case = os.path.basename(os.path.dirname(f))
    put("yaml", case, open(f, "rb").read())
put("dockerignore", "basic", b"node_modules\n*.log\n!keep.log\n**/target\n\0node_modules/x\na.log\nkeep.log\nsrc/target/debug")
put("dockerignore", "globs", b"# comment\n/abs/*\n[a-c]?.txt\ndir/**/deep\n\\#lit\n\0abs/x\nb1.txt\ndir/a/b/deep\n#lit")


# --- layers ------------------------------------------------------------------------------
def tar(entries, fmt=tarfile.PAX_FORMAT):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for e in entries:
            info = tarfile.TarInfo(e["name"])
            info.type = e.get("type", tarfile.REGTYPE)
            info.mode = e.get("mode", 0o644)
            info.uid = e.get("uid", 0)
            info.gid = e.get("gid", 0)
            info.mtime = e.get("mtime", 1700000000)
            info.linkname = e.get("link", "")
            info.devmajor, info.devminor = e.get("dev", (0, 0))
            info.pax_headers = e.get("pax", {})
            data = e.get("data", b"")
            info.size = len(data) if info.type == tarfile.REGTYPE else 0
            t.addfile(info, io.BytesIO(data) if info.type == tarfile.REGTYPE else None)
    return buf.getvalue()


D = tarfile.DIRTYPE
base = tar([
    {"name": "etc/", "type": D, "mode": 0o755},
    {"name": "etc/passwd", "data": b"root:x:0:0:root:/root:/bin/sh\n"},
    {"name": "etc/motd", "data": b"hello\n"},
    {"name": "bin/", "type": D, "mode": 0o755},
    {"name": "bin/sh", "data": b"\x7fELF", "mode": 0o4755},
    {"name": "bin/ash", "type": tarfile.LNKTYPE, "link": "bin/sh"},
    {"name": "usr/bin/env", "type": tarfile.SYMTYPE, "link": "/bin/sh"},
    {"name": "lib", "type": tarfile.SYMTYPE, "link": "usr/lib"},
    {"name": "usr/lib/libc.so", "data": b"lib"},
    {"name": "dev/null", "type": tarfile.CHRTYPE, "dev": (1, 3), "mode": 0o666},
    {"name": "dev/sda", "type": tarfile.BLKTYPE, "dev": (8, 0), "mode": 0o660},
    {"name": "run/fifo", "type": tarfile.FIFOTYPE},
    {"name": "home/user/", "type": D, "uid": 1000, "gid": 1000, "mode": 0o700},
    {"name": "tmp/", "type": D, "mode": 0o1777},
    {"name": "opt/cap", "data": b"x", "pax": {"SCHILY.xattr.security.capability": "\0\0\0\x02\0\x04" + "\0" * 14,
                                              "SCHILY.xattr.user.note": "v", "uid": "70000", "mtime": "1700000001.5"}},
])
upper = tar([
    {"name": "etc/.wh.motd", "data": b""},
    {"name": "home/user/.wh..wh..opq", "data": b""},
    {"name": "home/user/new", "data": b"new\n", "uid": 1000},
    {"name": "etc/passwd", "data": b"root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"},
    {"name": "lib/libm.so", "data": b"through the symlink"},
])
hostile = tar([
    {"name": "a", "type": tarfile.SYMTYPE, "link": "../../../../"},
    {"name": "a/escape", "data": b"x"},
    {"name": "b", "type": tarfile.SYMTYPE, "link": "/"},
    {"name": "b/tmp/escape", "data": b"x"},
    {"name": "c", "type": tarfile.LNKTYPE, "link": "../sentinel"},
    {"name": "../up", "data": b"x"},
])
for name, data in {
    "base": base,
    "base-gnu": tar([{"name": "x" * 150 + "/long", "data": b"long name"},
                     {"name": "l", "type": tarfile.SYMTYPE, "link": "t" * 120}], fmt=tarfile.GNU_FORMAT),
    "root-entry": tar([{"name": "/", "type": D, "mode": 0o755}, {"name": "/etc/x", "data": b"abs"}]),
    "two-layers": base + SEP + upper,
    "three-layers": base + SEP + upper + SEP + tar([{"name": "etc/.wh..wh..opq"}, {"name": "etc/new", "data": b"n"}]),
    "gzip": gzip.compress(base, mtime=0),
    "zstd": subprocess.run(["zstd", "-q", "-c"], input=upper, capture_output=True, check=True).stdout,
    "hostile": hostile,
    "big-uid": tar([{"name": "f", "data": b"x", "pax": {"uid": "4294967296"}}]),
    # Names and link targets past 100 bytes with a newline and a byte that is not UTF-8, in
    # GNU long-name records; and one with a NUL byte (the layer_flatten crash of 2026-12-04:
    # written back as a PAX path, which the reader split at the newline).
    "odd-names": tar([{"name": "n" * 100 + "\nline\udcff", "data": b"odd"},
                      {"name": "s\n", "type": tarfile.SYMTYPE, "link": "t\n" * 60 + "\udcfe"}],
                     fmt=tarfile.GNU_FORMAT),
    "nul-name": tar([{"name": "x" * 100 + "\0y", "data": b"x"}], fmt=tarfile.GNU_FORMAT),
    "replace-dir": tar([{"name": "d/", "type": D}, {"name": "d/f", "data": b"1"}]) + SEP +
                   tar([{"name": "d", "data": b"file now"}, {"name": "d2", "type": tarfile.LNKTYPE, "link": "d"}]),
}.items():
    put("layer_apply", name, data)
    put("layer_flatten", name, data)


# --- layer_tree_equivalence: op lists (fuzz_targets/layer_tree_equivalence.rs, decode) -------
def P(path):
    """A path byte: up to three components of a, b, c (2 bits each)."""
    b = 0
    for i, c in enumerate(path.split("/") if path else []):
        b |= ("abc".index(c) + 1) << (2 * i)
    return b


DIR, FILE, SYM, HARD, WH, OPQ, FIFO, NEXT = range(8)
for name, (layers, ops) in {
    # Links, a symlinked parent, whiteouts and an opaque directory over two layers.
    "mixed": (2, [(DIR, "a"), (FILE | 0x40, "a/b"), (SYM, "c", "a"), (HARD, "b", "a/b"), (NEXT, ""),
                  (WH, "a/b"), (OPQ, "a"), (FILE | 0x80, "c/c"), (FIFO | 0x28, "b/c")]),
    # Replacements: file over directory, directory over file, symlink over both.
    "replace": (3, [(DIR, "a"), (FILE, "a/b"), (FILE | 0x40, "b"), (NEXT, ""), (FILE | 0x80, "a"),
                    (DIR | 0x08, "b"), (NEXT, ""), (SYM, "a", "c"), (SYM, "b", "a"), (FILE, "c/c")]),
    # A hard link over the directory holding its target (refused by both, 2026-12-05).
    "link-over-own-dir": (1, [(DIR, "a"), (FILE, "a/a"), (HARD, "a", "a/a")]),
}.items():
    out = bytes([layers - 1])
    for op in ops:
        out += bytes([op[0], P(op[1])]) + (bytes([P(op[2])]) if len(op) > 2 else b"")
    put("layer_tree_equivalence", name, out)


# --- OCI manifests and configs ---------------------------------------------------------
def h(c):
    return "sha256:" + c * 64


oci_manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": h("a"), "size": 1469},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": h("b"), "size": 2479},
                           {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": h("c"), "size": 100,
                            "annotations": {"org.opencontainers.image.title": "x"}}]}
oci_index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": h("d"), "size": 500,
                            "platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}},
                           {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": h("e"), "size": 501,
                            "platform": {"os": "linux", "architecture": "amd64"}}]}
docker_manifest = dict(oci_manifest, mediaType="application/vnd.docker.distribution.manifest.v2+json")
docker_list = dict(oci_index, mediaType="application/vnd.docker.distribution.manifest.list.v2+json")
bare_index = {"schemaVersion": 2, "manifests": oci_index["manifests"][1:]}
for name, m in [("oci-manifest", oci_manifest), ("oci-index", oci_index), ("docker-manifest", docker_manifest),
                ("docker-list", docker_list), ("index-no-media-type", bare_index)]:
    put("oci_manifest", name, json.dumps(m).encode())
config = {"architecture": "amd64", "os": "linux", "created": "2026-01-01T00:00:00Z",
          "config": {"User": "1000:1000", "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "Entrypoint": ["/bin/sh"],
                     "Cmd": ["-c", "true"], "WorkingDir": "/workspace", "ExposedPorts": {"8080/tcp": {}},
                     "Volumes": {"/data": {}}, "Labels": {"a": "b"}, "StopSignal": "SIGTERM",
                     "Healthcheck": {"Test": ["CMD-SHELL", "true"], "Interval": 30000000000, "Retries": 3},
                     "OnBuild": ["RUN make"], "Shell": ["/bin/bash", "-c"]},
          "rootfs": {"type": "layers", "diff_ids": [h("f")]},
          "history": [{"created_by": "RUN true", "comment": "c"}, {"created_by": "ENV x=y", "empty_layer": True}]}
put("oci_config", "full", json.dumps(config).encode())
put("oci_config", "minimal", json.dumps({"architecture": "amd64", "os": "linux",
                                         "rootfs": {"type": "layers", "diff_ids": []}}).encode())
put("oci_config", "nulls", json.dumps({"architecture": "arm64", "os": "linux", "variant": "v8",
                                       "config": {"Env": None, "User": "", "WorkingDir": None}}).encode())

# --- store manifests, chunk tables, chunks ---------------------------------------------
disk = {"size": 200000, "chunking": {"cdc": {"min": 16384, "avg": 65536, "max": 262144}},
        "entries": [{"offset": 0, "rawLen": 65536, "digest": h("1"), "storedLen": 300},
                    {"offset": 65536, "rawLen": 65536},
                    {"offset": 131072, "rawLen": 68928, "digest": h("2"), "storedLen": 4000}]}
memory = {"size": 524288, "chunking": {"fixed": {"size": 262144}},
          "entries": [{"offset": 0, "rawLen": 262144, "digest": h("3"), "storedLen": 1000},
                      {"offset": 262144, "rawLen": 262144}]}
blob = {"digest": h("4"), "size": 10, "mediaType": "application/vnd.oci.image.config.v1+json"}
image = {"schemaVersion": 1, "mediaType": "application/vnd.kiln.image.manifest.v1+json", "disk": disk,
         "ociManifest": {"digest": h("5"), "size": 400}, "ociConfig": blob, "blobs": [{"digest": h("6"), "size": 7}],
         "recipeDigest": h("7"), "provenance": {"builder": "kiln 0.1.0"}, "snapshot": h("8"),
         "filesystem": {"kind": "ext4", "blockSize": 4096, "features": ["has_journal", "extent"], "uuid": "u",
                        "tool": {"mke2fs": "1.47.2"}},
         "sandbox": {"start": {"argv": ["/bin/sh", "-c", "serve"], "user": "1000", "env": ["A=b"], "workdir": "/w"},
                     "ready": {"argv": ["true"], "intervalMs": 100, "timeoutMs": 1000, "retries": 3}}}
snapshot = {"schemaVersion": 1, "mediaType": "application/vnd.kiln.snapshot.manifest.v1+json", "memory": memory,
            "vmstate": {"digest": h("9"), "size": 1}, "disk": disk, "compatibilityKey": "qemu-10.0;avx2;vcpus=2",
            "image": h("a"), "kernel": {"digest": h("b"), "size": 2}, "initramfs": {"digest": h("c"), "size": 3},
            "vcpus": 2, "memoryBytes": 524288}
put("store_manifest", "image", json.dumps(image, separators=(",", ":")).encode())
put("store_manifest", "image-minimal", json.dumps({"schemaVersion": 1, "mediaType": image["mediaType"],
                                                   "disk": {"size": 0, "chunking": {"fixed": {"size": 4096}},
                                                            "entries": []}}).encode())
put("store_manifest", "snapshot", json.dumps(snapshot, separators=(",", ":")).encode())
put("chunk_table", "cdc", json.dumps(disk).encode())
put("chunk_table", "fixed", json.dumps(memory).encode())
for name, raw in [("text", b"hello chunk\n" * 20), ("zeros", bytes(70000)), ("one", b"\xff")]:
    z = subprocess.run(["zstd", "-q", "-c", "--no-check"], input=raw, capture_output=True, check=True).stdout
    put("chunk_decode", name, bytes([20]) + z)
put("chunk_decode", "checksum", bytes([16]) + subprocess.run(["zstd", "-q", "-c", "--check"], input=b"abc" * 99,
                                                              capture_output=True, check=True).stdout)


# --- guest protocol --------------------------------------------------------------------
def frame(m):
    body = json.dumps(dict({"v": 1}, **m), separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


to_guest = [
    frame({"type": "connect", "nonce": 7}),
    frame({"type": "start", "argv": ["/bin/sh", "-c", "serve"], "user": "runtime", "env": ["A=b"], "workdir": "/w",
           "ready": {"argv": ["true"], "interval_ms": 100, "timeout_ms": 1000, "retries": 3}}),
    frame({"type": "restore", "entropy": "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=", "time_unix_ns": 1, "env": ["X=1"],
           "image_user": "1000", "image_env": ["PATH=/bin"]}),
    frame({"type": "exec", "id": 9, "argv": ["cat"], "env": ["A=1"], "user": "root", "workdir": "/",
           "stdin": "aGVsbG8=", "detach": False}),
    frame({"type": "ping", "nonce": 3}),
    frame({"type": "stats", "x": 1}),
]
from_guest = [
    frame({"type": "connected", "nonce": 42}),
    frame({"type": "hello", "init_version": "0.1.0"}),
    frame({"type": "ping", "nonce": 5}),
    frame({"type": "output", "id": 9, "seq": 0, "stream": "stdout", "data": "aGVsbG8="}),
    frame({"type": "exit", "id": 9, "seq": 1, "code": 0, "oom": False}),
    frame({"type": "exit", "id": 10, "seq": 0, "failure": {"kind": "not_found", "message": "no such file"}}),
    frame({"type": "ready", "elapsed_ms": 3, "attempts": 1}),
    frame({"type": "failed", "kind": "ready_timeout", "reason": "r"}),
    frame({"type": "restored", "machine_id": "m", "random": "r", "boot_id": "b"}),
    frame({"type": "error", "message": "refused"}),
    frame({"type": "unknown_kind"}),
]
put("guest_frames", "conversation", bytes([255]) + b"".join(to_guest))
put("guest_frames", "small-reads", bytes([2]) + b"".join(to_guest[:3]))
put("guest_frames", "stale-then-connect", bytes([63]) + b"\x00\x00\x01\x00{\"v\":1,\"ty" + b"".join(to_guest))
put("guest_frames", "bad-length", bytes([255]) + b"\x00\x00\x00\x00" + to_guest[4])
for i, f in enumerate(from_guest):
    put("host_channel", f"one-{i}", bytes([0]) + f)
put("host_channel", "conversation", bytes([0]) + b"".join(from_guest[1:]))
put("host_channel", "synced", bytes([1]) + b"\x00\x00\x01\x00{\"v\":1" + b"".join(from_guest))
