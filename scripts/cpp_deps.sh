#!/usr/bin/env bash
# The C++ runtime's build dependencies, without installing anything system-wide:
#   scripts/cpp_deps.sh DEST   ->  DEST/include/onnxruntime/*.h (ONNX Runtime's C/C++ API, Debian trixie's
#                                  libonnxruntime-dev 1.21.0: API version 21, not newer than the wheel's 1.32 library),
#                                  DEST/include/nlohmann/json.hpp (Debian's nlohmann-json3-dev 3.11.3),
#                                  DEST/include/pcre2.h (Debian's libpcre2-dev of the installed libpcre2-8-0's version:
#                                  the tokenizer's pre-tokenizer regex runs on the system's PCRE2 library)
# through a private APT configuration (its own state, lists and cache under DEST/apt) signed by Debian's archive
# keyring. The library is the onnxruntime wheel's libonnxruntime.so (runtime/cpp/CMakeLists.txt finds it).
set -euo pipefail
dest=$(realpath -m "${1:?usage: scripts/cpp_deps.sh DEST}")
[ -f "$dest/include/onnxruntime/onnxruntime_cxx_api.h" ] && [ -f "$dest/include/nlohmann/json.hpp" ] \
    && [ -f "$dest/include/pcre2.h" ] && exit 0
pcre2=$(dpkg-query -W -f='${Version}' libpcre2-8-0 2>/dev/null) \
    || { echo "cpp_deps.sh: the system has no libpcre2-8-0 (apt-get install libpcre2-8-0)" >&2; exit 1; }
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
apt="$dest/apt"
mkdir -p "$apt"/{state,cache,lists/partial,etc} "$dest/include"
touch "$apt/state/status"
{
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main"
    if [ "$suite" != trixie ]; then
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main"
    fi
} > "$apt/etc/sources.list"
cat > "$apt/etc/apt.conf" <<CONF
Dir::State "$apt/state";
Dir::State::Lists "$apt/lists";
Dir::Cache "$apt/cache";
Dir::Etc::SourceList "$apt/etc/sources.list";
Dir::Etc::SourceParts "/dev/null";
Dir::Etc::Preferences "/dev/null";
Dir::Etc::PreferencesParts "/dev/null";
APT::Sandbox::User "root";
CONF
export APT_CONFIG="$apt/etc/apt.conf"
apt-get update -qq
(cd "$apt" && apt-get download -qq libonnxruntime-dev=1.21.0+dfsg-1 nlohmann-json3-dev=3.11.3-2.1 "libpcre2-dev=$pcre2")
# the two pinned packages are checked against their known digests; libpcre2-dev follows the system's libpcre2-8-0
# and is checked, like every package apt downloads, against the archive's signed index
sha256sum -c --quiet <<SUMS
14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08  $(ls "$apt"/libonnxruntime-dev_*.deb)
741a6a32f61a14eaf9560ba1814b27da8e78fa3b9bed9e8867ab46316ddf3793  $(ls "$apt"/nlohmann-json3-dev_*.deb)
SUMS
for deb in "$apt"/*.deb; do dpkg-deb -x "$deb" "$apt/root"; done
cp -r "$apt/root/usr/include/onnxruntime" "$dest/include/"
cp -r "$apt/root/usr/include/nlohmann" "$dest/include/"
cp "$apt/root/usr/include/pcre2.h" "$dest/include/"
