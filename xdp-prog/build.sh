#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
#
# Build the two objects of the XDP steering program from xroce_xdp.c:
#
#   OUT_DIR/xroce_xdp.o        SEC("xdp"),       program "xroce_xdp"
#   OUT_DIR/xroce_xdp_frags.o  SEC("xdp.frags"), program "xroce_xdp_frags"
#
# Usage: xdp-prog/build.sh [OUT_DIR]      (default: xdp-prog/build/)
# Environment: CLANG=clang-14 to pick a compiler (default: clang, then clang-14).
#
# Needs clang (any version with the BPF target; Debian 12 ships 14) and the
# libbpf-dev headers (bpf/bpf_helpers.h). linux/bpf.h and the asm/ headers
# come from linux-libc-dev, which Debian installs under the multiarch
# directory /usr/include/<triplet>/asm; clang -target bpf does not search it
# by itself, so it is passed with -I (the alternative is gcc-multilib, which
# provides /usr/include/asm).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out_dir=${1:-$here/build}
src=$here/xroce_xdp.c

apt_hint="apt-get install -y --no-install-recommends clang libbpf-dev linux-libc-dev"

die_missing() {
	echo "build.sh: $1" >&2
	echo "build.sh: on Debian/Ubuntu install the build dependencies with:" >&2
	echo "    $apt_hint" >&2
	exit 1
}

# Compiler.
if [[ -n ${CLANG:-} ]]; then
	command -v "$CLANG" >/dev/null 2>&1 || die_missing "CLANG=$CLANG not found"
	clang=$CLANG
elif command -v clang >/dev/null 2>&1; then
	clang=clang
elif command -v clang-14 >/dev/null 2>&1; then
	clang=clang-14
else
	die_missing "clang not found"
fi
if ! "$clang" -print-targets 2>/dev/null | grep -qw bpf; then
	die_missing "$clang has no BPF target"
fi

# Multiarch include directory holding asm/ (asm/types.h etc.).
multiarch=$("$clang" -print-multiarch 2>/dev/null || true)
if [[ -z $multiarch ]] && command -v dpkg-architecture >/dev/null 2>&1; then
	multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || true)
fi
[[ -n $multiarch ]] || multiarch="$(uname -m)-linux-gnu"
includes=(-I"$here")
if [[ -f /usr/include/$multiarch/asm/types.h ]]; then
	includes+=(-I"/usr/include/$multiarch")
elif [[ ! -f /usr/include/asm/types.h ]]; then
	die_missing "asm/types.h not found (looked in /usr/include/$multiarch/asm and /usr/include/asm)"
fi

# Headers.
[[ -f /usr/include/linux/bpf.h ]] || die_missing "linux/bpf.h not found (linux-libc-dev)"
[[ -f /usr/include/bpf/bpf_helpers.h ]] || die_missing "bpf/bpf_helpers.h not found (libbpf-dev)"

mkdir -p "$out_dir"

cflags=(-O2 -g -target bpf -Wall -Wextra -Werror "${includes[@]}")

build() {
	local obj=$1
	shift
	local cmd=("$clang" "${cflags[@]}" "$@" -c "$src" -o "$out_dir/$obj")
	echo "+ ${cmd[*]}"
	"${cmd[@]}"
}

build xroce_xdp.o
build xroce_xdp_frags.o -DXROCE_FRAGS

echo "built: $out_dir/xroce_xdp.o $out_dir/xroce_xdp_frags.o"
