"""fs-sink under fan-in: ``--connect A,B`` writes one complete run per publisher."""

from __future__ import annotations

import torch

from consumers.fs import ActivationRun
from consumers.fs.per_publisher import run_name
from tests.support.fs_procs import log_of, publisher, step_message, wait_exit
from tests.support.procs import start_sink, wait_for


def test_two_publishers_one_run_each(tmp_path):
    addrs = [f"ipc://{tmp_path}/p{i}.sock" for i in range(2)]
    pubs = [publisher(a) for a in addrs]
    out = tmp_path / "runs"
    proc = start_sink(",".join(addrs), out, "--exit-on-end")
    try:
        for p in pubs:
            wait_for(lambda p=p: "fs-sink" in p.stats()["subscribers"], 60, "the sink subscribed")
        sent: dict[str, dict[int, torch.Tensor]] = {a: {} for a in addrs}
        for s in range(20):
            for k, (a, p) in enumerate(zip(addrs, pubs, strict=True)):
                h, t = step_message(s, [(f"req{k}-{s}", 0, 0, {"pub": k})])
                p.publish(h, t)
                sent[a][s] = t
        pubs[0].close()  # a restarts: a new run at the same address, while b goes on
        first_a = pubs[0].id
        pubs[0] = publisher(addrs[0])
        wait_for(lambda: "fs-sink" in pubs[0].stats()["subscribers"], 60, "the sink back")
        for s in range(20, 25):
            h, t = step_message(s, [(f"req0-{s}", 0, 0, {"pub": 0})])
            pubs[0].publish(h, t)
            sent[addrs[0]][s] = t
        for p in pubs:
            p.close()
        assert wait_exit(proc, out) == 0, log_of(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    for k, a in enumerate(addrs):
        run = ActivationRun(out / run_name(a))
        steps = range(25 if k == 0 else 20)
        # a's two runs are two streams of its run; b's one
        assert run.manifest["streams"] == ([first_a, pubs[0].id] if k == 0 else [pubs[1].id])
        table = run.dataset().to_table().sort_by("step")
        assert table.column("step").to_pylist() == [s for s in steps for _ in range(4)]
        assert set(table.column("request_id").to_pylist()) == {f"req{k}-{s}" for s in steps}
        assert torch.equal(run.decode(table), torch.cat([sent[a][s] for s in steps]))
        assert run.verify() == []
    assert "received=45" in log_of(out) and "received=25" in log_of(out)
