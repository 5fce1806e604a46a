import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tandem_core.cache import PROMPT_END, DiskTier, MemoryGate, ResidentPrefix, SessionSpill, SnapshotStore
from tandem_core.cache.gate import device_available
from tandem_core.state import ModelState, View

print(torch.__version__, torch.cuda.get_device_name())
d = "cuda"


def live():
    return ModelState({"gdn.S": torch.zeros(48, 128, 128, device=d),
                       "conv": torch.zeros(3, 64, dtype=torch.bfloat16, device=d)},
                      {"K": View(torch.zeros(4, 4096, 256, dtype=torch.bfloat16, device=d), 1)}, 0)


st = live()
r = ResidentPrefix(1024)
toks = list(range(3000))
for a in range(0, 3000, 500):
    st.views["K"].tensor[:, a:a + 500].normal_()
    st.sections["gdn.S"].normal_()
    st.length = a + 500
    r.commit(toks[a:a + 500], st)
r.mark_end(st, PROMPT_END)
print("anchors", [(x.position, x.kind, str(next(iter(x.sections.values())).device)) for x in r.anchors()])
t = time.perf_counter()
snap = r.snapshot(st)
print("snapshot to cpu %.3fs %d bytes" % (time.perf_counter() - t, snap.nbytes))
store = SnapshotStore(1 << 30)
assert store.offer(snap)
hit = store.lookup(np.asarray(toks + [7]), 3000)
s2 = live()
s2.restore(store.load(hit))
assert all(torch.equal(a, b) for a, b in zip(s2.tensors().values(), st.tensors().values()))
with tempfile.TemporaryDirectory() as tmp:
    gsnap = r.snapshot(st, device=d)
    t = time.perf_counter()
    assert DiskTier(tmp, "fp", 1 << 32).offer(gsnap)
    print("disk write from gpu %.3fs" % (time.perf_counter() - t))
    disk = DiskTier(tmp, "fp", 1 << 32)
    hit = disk.lookup(np.asarray(toks[:2100] + [1]), 2100)
    print("disk hit", hit.start)
    s3 = live()
    s3.restore(disk.load(hit))
    assert torch.equal(s3.sections["gdn.S"], r.anchors()[1].sections["gdn.S"])
    assert torch.equal(s3.views["K"].head(2048), st.views["K"].head(2048))
    SessionSpill(Path(tmp) / "sp", "fp").save({"s": gsnap})
    back = SessionSpill(Path(tmp) / "sp", "fp").load()["s"]
    s4 = live()
    ResidentPrefix(1024).adopt(back, s4)
    assert torch.equal(s4.views["K"].head(3000), st.views["K"].head(3000))
plan = r.plan(toks[:2500] + [9], st)
r.apply(plan, st)
print("resident", plan.describe().describe())
assert torch.equal(st.sections["gdn.S"], r.anchors()[-1].sections["gdn.S"])
x = torch.empty(1 << 30, dtype=torch.uint8, device=d)
before = device_available(d)
del x
after = device_available(d)
print("cuda available", before, after, after - before)
gate = MemoryGate(lambda n: n << 20, 256 * 4 * 2 * 2, [r, store], device=d)
print(gate.check(3000).available, store.stats(), r.stats())
print("OK")
