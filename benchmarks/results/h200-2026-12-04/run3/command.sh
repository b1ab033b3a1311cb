export PYTHONPATH=$PWD:/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1; O=$OUT; find muonscale benchmarks tests -name '*.py'|sort|xargs sha256sum >$O/manifest3.txt
for f in 'torch._foreach_add_(s,o)' 'torch._foreach_add_(s,o,alpha=1)' 'torch._foreach_add_(s,[o]*len(s))' 'torch._foreach_mul_(s,o)'; do timeout 30 python3 -c "import torch;s=[torch.zeros((),device='cuda') for _ in range(52)];o=torch.ones((),device='cuda');torch.cuda.synchronize();torch.cuda.set_sync_debug_mode('error')
try:
 $f;print('no sync:','$f')
except RuntimeError as e:print('sync:','$f',e)
torch.cuda.set_sync_debug_mode(0);g=torch.cuda.CUDAGraph()
with torch.cuda.graph(g):$f
g.replay();torch.cuda.synchronize();print('captured, replayed:','$f',s[0].item())" 2>&1|tail -3; done|tee $O/probe3.log
cat >/tmp/fa.py <<'E'
import torch
_f=torch._foreach_add_
def lst(ts,o):_f(ts,[o]*len(ts))
def loop(ts,o):[t.add_(o) for t in ts]
def fa(ts,o=None,*a,**k):
  if isinstance(o,torch.Tensor) and o.dim()==0 and o.is_cuda and not a and not k:return FIX(list(ts),o)
  return _f(ts,o,*a,**k)
s=[torch.zeros((),device="cuda") for _ in range(8)];o=torch.ones((),device="cuda")
torch.cuda.set_sync_debug_mode("error")
try:lst(s,o);FIX=lst
except RuntimeError:FIX=loop
torch.cuda.set_sync_debug_mode(0);torch._foreach_add_=fa;print("patched foreach_add_ with",FIX.__name__)
E
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider -p fa -k gpu --junitxml=$O/pytest3.xml tests/test_capturable.py tests/test_docs_code.py 2>&1|tee $O/pytest3.log|tail -4
timeout 90 python3 -c "import fa,runpy,sys;sys.argv=['gpu.py','--out','$O/gr','--only','graph'];runpy.run_path('benchmarks/gpu.py',run_name='__main__')" 2>&1|tee $O/graph.log|tail -8
timeout 150 python3 benchmarks/gpu.py --out $O/re --only matmul --only optimizer --only e2e 2>&1|tee $O/re.log|tail -30
