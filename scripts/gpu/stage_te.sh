#!/usr/bin/env bash
# Stage TransformerEngine for a GPU machine that has no network, then install it there.
#
#   prepare             (here, with pip access) download TE's wheels, its PyTorch extension's
#                       source and the runtime packages TE imports into .stage/, and cut the
#                       ~276 MB core wheel into 60 MiB parts, one folder per part (a device
#                       call carries 64 MiB at most)
#   install [--wait S]  (there) keep the carried parts in $TE_WORK (any order, several per
#                       call); once every part and the extras are there, join the parts,
#                       check sha256, pip-install
#                       the wheels, start building the extension in the background (setsid,
#                       log in $TE_WORK/build.log) and wait up to S seconds for it
#   poll [--wait S]     (there) say how far install got, waiting up to S seconds for a
#                       running build; once it ended, import TE and run a layer on the GPU
#
# The device machine keeps /tmp only while it stays warm (about 30 s between calls), so the
# install calls go back to back; each call says which parts are still missing.
# Target: Python 3.12, torch 2.x + CUDA 13, x86-64, Hopper (sm_90). See scripts/gpu/README.md.
set -euo pipefail

TE_VERSION="${TE_VERSION:-2.20.2}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STAGE="${STAGE:-$REPO/.stage}"
TE_WORK="${TE_WORK:-/tmp/te_stage}"
PYTHON="${PYTHON:-python3}"
PART_SIZE="${PART_SIZE:-60m}"
PYPI_JSON="${PYPI_JSON:-https://pypi.org/pypi}"
PYPI_SIMPLE="${PYPI_SIMPLE:-https://pypi.org/simple}"
# What TransformerEngine's Python side needs beyond torch and what the GPU image already has
# (einops, onnx, onnxscript, packaging, pyyaml are there): pydantic (recipes) with its
# pinned core, nvdlfw-inspect (imported by the debug hooks), importlib-metadata, and
# nvidia-cudnn-frontend (its headers, for the extension's build). Pinned so that pydantic
# and pydantic-core agree and nothing needs a newer typing-extensions than the image's.
RUNTIME_WHEELS=(pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0
  typing-inspection==0.4.1 importlib-metadata==8.7.0 nvdlfw-inspect==0.2.2
  nvidia-cudnn-frontend==1.32.0)
# imported by `import transformer_engine.pytorch`; checked before the build starts
RUNTIME_MODULES=(einops pydantic onnx onnxscript nvdlfw_inspect packaging yaml)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

say() { printf '%s\n' "$*"; }
die() {
  printf 'stage_te.sh: %s\n' "$*" >&2
  exit 1
}
manifest_get() { if [[ -f "$1" ]]; then sed -n "s/^$2=//p" "$1"; fi; }
count_lines() { if [[ -f "$1" ]]; then wc -l <"$1"; else echo 0; fi; }
wait_seconds() { if [[ "${1:-}" == "--wait" ]]; then echo "${2:?--wait needs seconds}"; else echo 0; fi; }

fetch_sdist() {
  # `pip download` of this sdist would first prepare its metadata in an isolated
  # environment holding a CUDA build of torch (minutes, GBs); the index's JSON API names
  # the file directly (the URL may be relative to the API's, on a mirror). Where the JSON
  # API answers 404 for a release (seen for 2.20.2), the simple index's page (PEP 503)
  # names it too, with its sha256.
  "$PYTHON" - "$PYPI_JSON" "$PYPI_SIMPLE" "$TE_VERSION" "$1" <<'PY'
import hashlib, json, re, sys, urllib.error, urllib.parse, urllib.request
api, simple, version, dest = sys.argv[1:5]
name = f"transformer_engine_torch-{version}.tar.gz"
url, sha256 = None, None
try:
    with urllib.request.urlopen(f"{api}/transformer-engine-torch/{version}/json") as response:
        files = json.load(response)["urls"]
    sdist = next(f for f in files if f["packagetype"] == "sdist")
    url = urllib.parse.urljoin(api + "/", sdist["url"])
    sha256 = sdist.get("digests", {}).get("sha256")
except urllib.error.HTTPError as error:
    print(f"JSON API: {error}; reading the simple index")
    page_url = f"{simple}/transformer-engine-torch/"
    with urllib.request.urlopen(page_url) as response:
        page = response.read().decode()
    match = re.search(r'href="([^"]*/' + re.escape(name) + r')(?:#sha256=([0-9a-f]+))?"', page)
    if match is None:
        sys.exit(f"{name} is not on {page_url}")
    url, sha256 = urllib.parse.urljoin(page_url, match.group(1)), match.group(2)
urllib.request.urlretrieve(url, dest)
with open(dest, "rb") as handle:
    digest = hashlib.sha256(handle.read()).hexdigest()
if sha256 and digest != sha256:
    sys.exit(f"{name}: sha256 {digest} differs from the index's {sha256}")
print("fetched", name, "sha256", digest)
PY
}

prepare() {
  local download="$STAGE/download"
  rm -rf "$STAGE"/part* "$STAGE/extras" "$STAGE/split"
  mkdir -p "$download/deps"
  say "== TransformerEngine $TE_VERSION wheels (the core one is ~276 MB)"
  "$PYTHON" -m pip download --no-deps "${TARGET[@]}" -d "$download" \
    "transformer-engine-cu13==$TE_VERSION" "transformer-engine==$TE_VERSION"
  local sdist="$download/transformer_engine_torch-$TE_VERSION.tar.gz"
  if [[ -n "${TE_SDIST:-}" ]]; then
    cp "$TE_SDIST" "$sdist"
  elif [[ ! -f "$sdist" ]]; then
    say "== transformer-engine-torch $TE_VERSION source"
    fetch_sdist "$sdist"
  fi
  say "== runtime wheels: ${RUNTIME_WHEELS[*]}"
  rm -f "$download"/deps/*.whl
  "$PYTHON" -m pip download --no-deps "${TARGET[@]}" -d "$download/deps" "${RUNTIME_WHEELS[@]}"

  local core
  core="$(cd "$download" && ls transformer_engine_cu13-"$TE_VERSION"-*.whl)"
  local split_dir="$STAGE/split"
  mkdir -p "$split_dir"
  split -b "$PART_SIZE" -d -a 2 "$download/$core" "$split_dir/$core.part"
  local parts=("$split_dir/$core".part*)
  local manifest="$STAGE/MANIFEST"
  {
    echo "version=$TE_VERSION"
    echo "wheel=$core"
    echo "sha256=$(sha256sum "$download/$core" | cut -d' ' -f1)"
    echo "parts=${#parts[@]}"
    local part
    for part in "${parts[@]}"; do
      echo "$(basename "$part")=$(sha256sum "$part" | cut -d' ' -f1)"
    done
  } >"$manifest"
  local index=0 part
  for part in "${parts[@]}"; do
    mkdir -p "$STAGE/part$index"
    mv "$part" "$STAGE/part$index/"
    cp "$manifest" "$STAGE/part$index/MANIFEST"
    index=$((index + 1))
  done
  rmdir "$split_dir"
  mkdir -p "$STAGE/extras/deps"
  cp "$download"/transformer_engine-"$TE_VERSION"-*.whl "$sdist" "$STAGE/extras/"
  cp "$download"/deps/*.whl "$STAGE/extras/deps/"
  cp "$manifest" "$STAGE/extras/MANIFEST"
  say "== staged in $STAGE"
  du -sh "$STAGE"/part* "$STAGE/extras"
  say "Carry one or more folders per device call (64 MiB in all), in any order, calls back"
  say "to back, each running: bash scripts/gpu/stage_te.sh install [--wait 540]"
  local i
  for ((i = 0; i < index; i++)); do say "  carry [\".stage/part$i\"]"; done
  say "  carry [\".stage/extras\"]   (with the smallest part, or on its own)"
}

append_parts() {
  # keep every carried part whose sha256 matches the MANIFEST, whatever the order; once all
  # are here, join them and check the whole wheel. ASSEMBLED=1 when the wheel is whole.
  ASSEMBLED=0
  mkdir -p "$TE_WORK/parts"
  local folder
  for folder in "$STAGE"/part* "$STAGE/extras"; do
    if [[ -f "$folder/MANIFEST" ]]; then cp "$folder/MANIFEST" "$TE_WORK/MANIFEST"; fi
  done
  [[ -f "$TE_WORK/MANIFEST" ]] || die "no MANIFEST: carry a .stage/partN or .stage/extras folder"
  local wheel parts sha
  wheel="$(manifest_get "$TE_WORK/MANIFEST" wheel)"
  parts="$(manifest_get "$TE_WORK/MANIFEST" parts)"
  sha="$(manifest_get "$TE_WORK/MANIFEST" sha256)"
  if [[ -f "$TE_WORK/wheels/$wheel" ]]; then
    ASSEMBLED=1
    return 0
  fi
  local index name expected file
  for ((index = 0; index < parts; index++)); do
    name="$(printf '%s.part%02d' "$wheel" "$index")"
    file="$STAGE/part$index/$name"
    [[ -f "$file" && ! -f "$TE_WORK/parts/$name" ]] || continue
    expected="$(manifest_get "$TE_WORK/MANIFEST" "$name")"
    [[ "$(sha256sum "$file" | cut -d' ' -f1)" == "$expected" ]] ||
      die "$name is corrupt (its sha256 differs from the MANIFEST's); carry .stage/part$index again"
    cp "$file" "$TE_WORK/parts/$name.tmp" && mv "$TE_WORK/parts/$name.tmp" "$TE_WORK/parts/$name"
    say "kept $name"
  done
  local missing=()
  for ((index = 0; index < parts; index++)); do
    name="$(printf '%s.part%02d' "$wheel" "$index")"
    [[ -f "$TE_WORK/parts/$name" ]] || missing+=(".stage/part$index")
  done
  if ((${#missing[@]})); then
    say "core wheel: $((parts - ${#missing[@]}))/$parts parts here; still to carry: ${missing[*]}"
    return 0
  fi
  for ((index = 0; index < parts; index++)); do
    cat "$TE_WORK/parts/$(printf '%s.part%02d' "$wheel" "$index")"
  done >"$TE_WORK/$wheel.partial"
  [[ "$(sha256sum "$TE_WORK/$wheel.partial" | cut -d' ' -f1)" == "$sha" ]] ||
    die "the reassembled $wheel fails its sha256; rm -rf $TE_WORK and carry every part again"
  mkdir -p "$TE_WORK/wheels"
  mv "$TE_WORK/$wheel.partial" "$TE_WORK/wheels/$wheel"
  rm -rf "$TE_WORK/parts"
  say "core wheel reassembled, sha256 ok: $TE_WORK/wheels/$wheel"
  ASSEMBLED=1
}

wait_for_build() {
  local limit="$1" start="$SECONDS"
  while [[ ! -f "$TE_WORK/build.rc" ]] && ((SECONDS - start < limit)); do
    sleep 15
    say "[$((SECONDS - start)) s] $(count_lines "$TE_WORK/build.log") log lines; last:" \
      "$(tail -n 1 "$TE_WORK/build.log" 2>/dev/null | cut -c1-160)"
  done
}

install() {
  local wait
  wait="$(wait_seconds "$@")"
  append_parts
  if [[ -d "$STAGE/extras" ]]; then
    mkdir -p "$TE_WORK/extras"
    cp -r "$STAGE/extras/." "$TE_WORK/extras/"
    say "extras copied to $TE_WORK/extras"
  fi
  ((ASSEMBLED)) || return 0
  if [[ ! -d "$TE_WORK/extras" ]]; then
    say "extras: not here yet; carry .stage/extras"
    return 0
  fi
  if [[ -f "$TE_WORK/build.started" ]]; then
    say "the build was started already"
    poll --wait "$wait"
    return
  fi
  local wheel
  wheel="$(manifest_get "$TE_WORK/MANIFEST" wheel)"
  say "== runtime wheels that are not installed yet (installed ones are kept)"
  local missing_wheels
  mapfile -t missing_wheels < <("$PYTHON" - "$TE_WORK/extras/deps" <<'PY'
import importlib.metadata, pathlib, sys
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        importlib.metadata.version(wheel.name.split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
PY
  )
  if ((${#missing_wheels[@]})); then
    "$PYTHON" -m pip install --no-deps --no-index "${missing_wheels[@]}"
  fi
  "$PYTHON" -c "import importlib.util, sys
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
sys.exit(f'not importable, stage them: {missing}' if missing else 0)" "${RUNTIME_MODULES[@]}"
  say "== TransformerEngine wheels"
  "$PYTHON" -m pip install --no-deps --no-index \
    "$TE_WORK/wheels/$wheel" "$TE_WORK/extras/transformer_engine-$TE_VERSION"-*.whl
  # With a CUDA toolkit present, TE's build adds only the toolkit's include directory, but
  # the extension also includes cudnn.h and nccl.h, which come with torch's pip packages
  # (nvidia/*/include); CPATH is searched after -I, so the toolkit's own headers still win.
  local nvidia_includes
  nvidia_includes="$("$PYTHON" - <<'PY'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
found = {d for r in roots for d in glob.glob(os.path.join(r, "**", "include"), recursive=True)}
# nvidia-cudnn-frontend puts cudnn_frontend.h in site-packages/include
from importlib.metadata import PackageNotFoundError, distribution
try:
    found.add(str(distribution("nvidia-cudnn-frontend").locate_file("include")))
except PackageNotFoundError:
    pass
print(":".join(sorted(d for d in found if os.path.isdir(d))))
PY
)"
  export CPATH="${nvidia_includes}${CPATH:+:$CPATH}"
  say "CPATH for cuDNN/NCCL headers: ${CPATH:-<none>}"
  say "== building the PyTorch extension in the background (log: $TE_WORK/build.log)"
  touch "$TE_WORK/build.started"
  # NVTE_PYTORCH_FORCE_BUILD: the setup script would first try to download a prebuilt wheel
  # from GitHub, which that machine cannot reach. NVTE_WITH_NCCL_EP=0: expert-parallel
  # support needs nccl_ep.h, which torch's NCCL wheel does not ship (layerswap does not use
  # it). The inner shell records its own pid (setsid may fork) and pip's exit code.
  # shellcheck disable=SC2016  # $0..$2 belong to the inner shell
  setsid nohup env NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90}" \
    MAX_JOBS="${MAX_JOBS:-16}" NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_WITH_NCCL_EP=0 \
    bash -c 'echo $$ >"$2/build.pid"
      "$0" -m pip install --no-build-isolation --no-deps --no-index -v "$1" >"$2/build.log" 2>&1
      echo $? >"$2/build.rc"' \
    "$PYTHON" "$TE_WORK/extras/transformer_engine_torch-$TE_VERSION.tar.gz" "$TE_WORK" \
    </dev/null >/dev/null 2>&1 &
  sleep 2
  poll --wait "$wait"
}

poll() {
  local wait
  wait="$(wait_seconds "$@")"
  [[ -d "$TE_WORK" ]] || die "$TE_WORK does not exist: nothing was installed on this machine"
  if [[ -f "$TE_WORK/wheels/$(manifest_get "$TE_WORK/MANIFEST" wheel)" ]]; then
    say "core wheel: reassembled"
  else
    say "core wheel: $(find "$TE_WORK/parts" -name '*.part??' 2>/dev/null | wc -l)/$(manifest_get "$TE_WORK/MANIFEST" parts) parts here"
  fi
  if [[ ! -f "$TE_WORK/build.started" ]]; then
    say "build: not started"
    return 0
  fi
  wait_for_build "$wait"
  if [[ ! -f "$TE_WORK/build.rc" ]]; then
    if [[ -f "$TE_WORK/build.pid" ]] && kill -0 "$(cat "$TE_WORK/build.pid")" 2>/dev/null; then
      say "build: running ($(count_lines "$TE_WORK/build.log") log lines); last lines:"
    else
      say "build: its process is gone without an exit code; last lines:"
    fi
    tail -n 15 "$TE_WORK/build.log" 2>/dev/null || true
    return 0
  fi
  local rc
  rc="$(cat "$TE_WORK/build.rc")"
  say "build: finished with exit code $rc"
  if [[ "$rc" != 0 ]]; then
    grep -n -i -m 20 'error' "$TE_WORK/build.log" || true
    tail -n 30 "$TE_WORK/build.log"
    return 1
  fi
  "$PYTHON" - <<'PY'
import torch
import transformer_engine
import transformer_engine.pytorch as te

print("transformer_engine", transformer_engine.__version__, "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name())
layer = te.Linear(64, 64, params_dtype=torch.bfloat16)
out = layer(torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
print("te.Linear ran:", tuple(out.shape), out.dtype)
PY
}

command="${1:-}"
shift || true
case "$command" in
  prepare) prepare ;;
  install) install "$@" ;;
  poll) poll "$@" ;;
  *)
    say "usage: bash scripts/gpu/stage_te.sh prepare | install [--wait SECONDS] | poll [--wait SECONDS]" >&2
    exit 2
    ;;
esac
