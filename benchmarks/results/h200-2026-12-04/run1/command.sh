export GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0='*'; B=$(git rev-parse --abbrev-ref HEAD 2>/dev/null); echo "traveled: ${B:-no git} $PWD"; if [ "$B" != h/gpu ] && git rev-parse -q --verify refs/heads/h/gpu >/dev/null 2>&1; then export TREE="h/gpu $(git rev-parse h/gpu), git archive in a tree on $B"; mkdir -p /tmp/g && git archive h/gpu | tar -x -C /tmp/g && cd /tmp/g; fi; [ -n "$B" ] || export TREE="no git: the traveled tree as is"
O=${OUT:-runs/gpu_check}; P=${PY:-python3}; mkdir -p $O
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
{ date -u; echo "tree: ${TREE:-$(git rev-parse --abbrev-ref HEAD) $(git rev-parse HEAD)}"; nvidia-smi
$P -c 'import sys,torch,triton,numpy as n;c=torch.cuda.is_available();print(sys.version,"torch",torch.__version__,torch.version.cuda,"triton",triton.__version__,"numpy",n.__version__,torch.cuda.get_device_name() if c else "no CUDA")'
} >$O/env.txt 2>&1; cat $O/env.txt
find muonscale benchmarks tests -name '*.py' | sort | xargs sha256sum >$O/manifest.txt
T=$($P -c 'import pytest_timeout' 2>/dev/null && echo --timeout=90)
timeout 120 $P -m pytest -q -rs -p no:cacheprovider $T -k 'gpu or cuda' --junitxml=$O/pytest.xml \
 tests/test_kernels.py tests/test_capturable.py tests/test_triton_elementwise.py \
 tests/test_docs_code.py tests/test_torch_optim_contracts.py 2>&1 | tee $O/pytest.log
timeout 270 $P benchmarks/gpu.py --out $O --budget-s ${BUDGET_S:-230} $BENCH_ARGS $(for s in \
 matmul correctness ns optimizer e2e memory graph profile backward_ns; do echo --only $s; done) \
 2>&1 | tee $O/bench.log
