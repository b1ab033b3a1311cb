export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1; O=$OUT; find muonscale benchmarks tests -name '*.py'|sort|xargs sha256sum >$O/manifest2.txt
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider --timeout=90 --continue-on-collection-errors -k 'gpu or cuda' --junitxml=$O/pytest2.xml tests/test_kernels.py tests/test_capturable.py tests/test_triton_elementwise.py tests/test_docs_code.py tests/test_torch_optim_contracts.py 2>&1|tee $O/pytest2.log
P='import torch,muonscale,traceback as tb
from benchmarks.gpu_parts.models import param_set
def mk(nf="raise",w="muon adamw"):
  m,a=param_set(12,768,"cuda");d=dict(muon=m,adamw=a)
  o=muonscale.Muon([{"params":[p for _,p in d[k]],"algorithm":k} for k in w.split()],lr=torch.tensor(1e-3,device="cuda"),ns_dtype=torch.bfloat16,capturable=True,nonfinite=nf)
  s=torch.cuda.Stream();s.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(s):
    for _ in range(3):o.step()
  torch.cuda.current_stream().wait_stream(s);torch.cuda.synchronize();return o
def cap(f):
  g=torch.cuda.CUDAGraph()
  try:
    with torch.cuda.graph(g):f()
    print("capture ok")
  except Exception:tb.print_exc(limit=-6)
'
for t in 'o=mk();torch.cuda.set_sync_debug_mode("error");o.step();print("eager: no sync")' 'st=[torch.zeros((),device="cuda") for _ in range(52)];f=torch.ones((),dtype=torch.bool,device="cuda");torch.cuda.synchronize();cap(lambda:torch._foreach_add_(st,f.to(torch.float32)))' 'cap(mk("ignore").step)' 'cap(mk(w="muon").step)' 'cap(mk(w="adamw").step)' 'cap(mk().step)'; do echo "== $t"; timeout 60 python3 -c "$P
$t" 2>&1|tail -25; done 2>&1|tee $O/probe.log
mkdir -p $O/pb $O/gr; timeout 120 python3 benchmarks/gpu.py --out $O/pb --only profile --only backward_ns 2>&1|tee $O/pb/bench.log|tail -30
timeout 60 python3 benchmarks/gpu.py --out $O/gr --only graph 2>&1|tail -8
