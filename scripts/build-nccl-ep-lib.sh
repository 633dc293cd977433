#!/usr/bin/env bash
# Builds epflow's libnccl_ep (NCCL EP's C API on epflow's kernels, crate epflow-nccl-ep-abi) and
# lays it out as NVIDIA ships NCCL EP, under DEST (default: <cargo target dir>/nccl_ep):
#
#   DEST/lib/libnccl_ep.so.<major>.<minor>.<patch>   the shared library (SONAME libnccl_ep.so.<major>)
#   DEST/lib/libnccl_ep.so.<major> -> libnccl_ep.so.<major>.<minor>.<patch>
#   DEST/lib/libnccl_ep.so         -> libnccl_ep.so.<major>
#   DEST/lib/libnccl_ep.a           the static library (Rust staticlib: links with the system
#                                   libraries rustc names, printed at the end and written to
#                                   DEST/lib/libnccl_ep.a.libs)
#   DEST/include/nccl_ep.h          API version 1 (NCCL_EP_API_VERSION defined to 2 before it: v2)
#   DEST/include/nccl_ep_v2.h       API version 2
#
# One cargo command builds both libraries (the crate's crate-type has cdylib and staticlib):
# `cargo rustc --release -p epflow-nccl-ep-abi --lib -- --print native-static-libs`, the same
# build as `cargo build --release` plus rustc's list of the system libraries the static one
# needs. The version comes from the generated header (NCCL_EP_MAJOR/MINOR/PATCH). Usage:
#   scripts/build-nccl-ep-lib.sh [DEST]
# then, e.g., gcc app.c -I DEST/include -L DEST/lib -lnccl_ep   (shared), or
#   gcc app.c -I DEST/include DEST/lib/libnccl_ep.a $(cat DEST/lib/libnccl_ep.a.libs)   (static)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=${CARGO_TARGET_DIR:-$root/target}
dest=${1:-$target/nccl_ep}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! cargo rustc --release -p epflow-nccl-ep-abi --lib -- --print native-static-libs 2>"$log"; then
    cat "$log" >&2
    exit 1
fi
grep -v -e '^note: ' -e '^$' "$log" >&2 || true
native=$(sed -n 's/^note: native-static-libs: //p' "$log" | tail -n 1)
if [ -z "$native" ]; then
    echo "error: rustc printed no native-static-libs (is staticlib in crates/nccl-ep-abi/Cargo.toml's crate-type?)" >&2
    exit 1
fi

header=crates/nccl-ep-abi/include/nccl_ep.h
field() { sed -n "s/^#define NCCL_EP_$1 \([0-9]*\)$/\1/p" "$header" | head -n 1; }
major=$(field MAJOR)
minor=$(field MINOR)
patch=$(field PATCH)
if [ -z "$major" ] || [ -z "$minor" ] || [ -z "$patch" ]; then
    echo "error: no NCCL_EP_MAJOR/MINOR/PATCH in $header" >&2
    exit 1
fi
version=$major.$minor.$patch

release=$target/release
for f in libnccl_ep.so libnccl_ep.a; do
    if [ ! -f "$release/$f" ]; then
        echo "error: cargo did not write $release/$f (is staticlib in crates/nccl-ep-abi/Cargo.toml's crate-type?)" >&2
        exit 1
    fi
done
if command -v readelf >/dev/null 2>&1; then
    soname=$(readelf -d "$release/libnccl_ep.so" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')
    if [ "$soname" != "libnccl_ep.so.$major" ]; then
        echo "error: $release/libnccl_ep.so has SONAME '$soname', not libnccl_ep.so.$major (crates/nccl-ep-abi/build.rs)" >&2
        exit 1
    fi
fi

mkdir -p "$dest/lib" "$dest/include"
rm -f "$dest/lib/libnccl_ep.so" "$dest/lib/libnccl_ep.so.$major" "$dest/lib/libnccl_ep.so.$version" \
    "$dest/lib/libnccl_ep.a" "$dest/lib/libnccl_ep.a.libs"
cp "$release/libnccl_ep.so" "$dest/lib/libnccl_ep.so.$version"
chmod 755 "$dest/lib/libnccl_ep.so.$version"
ln -s "libnccl_ep.so.$version" "$dest/lib/libnccl_ep.so.$major"
ln -s "libnccl_ep.so.$major" "$dest/lib/libnccl_ep.so"
cp "$release/libnccl_ep.a" "$dest/lib/libnccl_ep.a"
echo "$native" >"$dest/lib/libnccl_ep.a.libs"
cp crates/nccl-ep-abi/include/nccl_ep.h crates/nccl-ep-abi/include/nccl_ep_v2.h "$dest/include/"
chmod 644 "$dest/lib/libnccl_ep.a" "$dest/lib/libnccl_ep.a.libs" "$dest/include/nccl_ep.h" "$dest/include/nccl_ep_v2.h"

echo "epflow libnccl_ep $version in $dest:"
ls -l "$dest/lib" "$dest/include" | sed 's/^/  /'
echo "shared: -I $dest/include -L $dest/lib -lnccl_ep   (run with $dest/lib on LD_LIBRARY_PATH)"
echo "static: -I $dest/include $dest/lib/libnccl_ep.a $native"
