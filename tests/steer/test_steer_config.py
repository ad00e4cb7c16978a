"""Steering input without an engine: the config, request entries, named vectors from
files and checkpoints, cache salts, and the worker's table rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from actbus.config import CaptureConfig
from actbus.errors import ConfigError
from actbus.steer.config import SteerConfig, VectorSource, parse_steer
from actbus.steer.frontend import SteerFrontend
from actbus.steer.graph import SteerTables
from actbus.steer.vectors import VectorRegistry
from actbus.steer.worker import Steerer
from actbus.steps import StepRequests

H = 8


def test_engine_config():
    cfg = CaptureConfig.from_dict(
        {"layers": [1], "steer": {"layers": [0, 2], "hooks": ["pre_attn", "post_block"]}}
    )
    assert cfg.steer.resolve_layers(4) == (0, 2) and cfg.steer.hooks == ("pre_attn", "post_block")
    assert CaptureConfig.from_dict({"layers": [1]}).steer is None
    for raw, needle in [
        ({"hooks": ["mlp_out"]}, "actbus.steer.hooks[0]: 'mlp_out' is not a steering point"),
        ({"per_token": 0}, "actbus.steer.per_token"),
        ({"colour": 1}, "actbus.steer.colour: unknown key"),
        ({"vectors": {"a": {"sae": "d"}}}, "actbus.steer.vectors.a.feature"),
        ({"vectors": {"a": {"file": "f", "sae": "d"}}}, "actbus.steer.vectors.a: give exactly one"),
        ({"global": [{"vector": "a"}]}, "actbus.steer.global[0].layers: required"),
        ({"vector_dirs": ["rel/dir"]}, "actbus.steer.vector_dirs[0]: 'rel/dir' is not an absol"),
        ({"vector_dirs": [3]}, "actbus.steer.vector_dirs: expected a list of directories"),
        ({"max_named": 0}, "actbus.steer.max_named: expected an integer in 1..65536"),
    ]:
        with pytest.raises(ConfigError) as e:
            SteerConfig.from_dict(raw)
        assert needle in str(e.value), (raw, str(e.value))
    with pytest.raises(ConfigError, match="layer 7 is out of range"):
        SteerConfig.from_dict({"layers": [7]}).resolve_layers(4)


def test_entries_expand_per_layer_and_hook():
    specs = parse_steer(
        [{"vector": "v", "layers": [2, 1], "hooks": ["post_attn", "pre_attn"], "scale": 2}],
        "s",
        num_layers=4,
        layers=(1, 2),
    )
    assert [(s.layer, s.hook, s.scale) for s in specs] == [
        (1, "post_attn", 2.0),
        (1, "pre_attn", 2.0),
        (2, "post_attn", 2.0),
        (2, "pre_attn", 2.0),
    ]
    with pytest.raises(ConfigError, match=r"s\[0\].layers\[0\]: layer 3 cannot be steered"):
        parse_steer([{"vector": "v", "layers": 3}], "s", num_layers=4, layers=(1, 2))
    with pytest.raises(ConfigError, match=r"s\[0\].positions: 'last' is not known"):
        parse_steer([{"vector": "v", "layers": 1, "positions": "last"}], "s")
    with pytest.raises(ConfigError, match=r"s\[0\].norm_match"):
        parse_steer([{"vector": "v", "layers": 1, "norm_match": 1}], "s")


def test_entries_are_counted_before_they_are_read_or_expanded():
    """A list that expands past 64 (layer, hook) entries is refused before any entry is
    read (a later entry's own fault is not even looked at), as are over-long lists and
    inline vectors wider than the model, before they are converted."""
    hooks = ["pre_attn", "post_block"]
    wide = [{"vector": "v", "layers": list(range(40)), "hooks": hooks}, {"vector": "v", "x": 1}]
    with pytest.raises(ConfigError, match=r"^s: more than 64 .* \(entry 0 reaches 80\)"):
        parse_steer(wide, "s")
    with pytest.raises(ConfigError, match=r"^s: 100000 entries; at most 64"):
        parse_steer([{"vector": [0.5] * H, "layers": 1}] * 100_000, "s")
    with pytest.raises(ConfigError, match=r"^s\[0\].layers: 100000 items; at most 4096"):
        parse_steer([{"vector": "v", "layers": list(range(100_000))}], "s")
    with pytest.raises(ConfigError, match=r"^s\[1\].vector: has 9 values; this model's .* has 8"):
        parse_steer(
            [{"vector": "v", "layers": 1}, {"vector": [1.0] * 9, "layers": 1}], "s", width=H
        )
    with pytest.raises(ConfigError, match=r"^s\[0\].vector: has 1000000 values; at most"):
        parse_steer([{"vector": [1.0] * 1_000_000, "layers": 1}], "s")
    assert len(parse_steer([{"vector": "v", "layers": list(range(32)), "hooks": hooks}], "s")) == 64


def test_http_sources_stay_in_the_vector_dirs_and_registrations_are_capped(tmp_path):
    """An HTTP caller's path source (``confine``) is read only inside the listed
    directories, links followed; outside, the refusal is the same whether the file
    exists or not, and names no tensor. A tensor too big is refused from its header;
    a registry holds at most ``max_named`` names (replacing one is always allowed)."""
    from actbus import checkpoints
    from actbus.steer.vectors import Confine

    inside, outside = tmp_path / "vectors", tmp_path / "private"
    inside.mkdir(), outside.mkdir()
    save_file({"secret_name": torch.ones(H)}, str(outside / "weights.safetensors"))
    save_file({"v": torch.ones(H), "w": torch.ones(H)}, str(inside / "ok.safetensors"))
    (inside / "link.safetensors").symlink_to(outside / "weights.safetensors")
    (inside / "up").symlink_to(outside)
    reg = VectorRegistry(H, max_named=2)
    confine = Confine((str(inside),))
    refusals = set()
    for path in (
        outside / "weights.safetensors",  # exists, outside
        outside / "missing.safetensors",  # does not exist
        inside / "link.safetensors",  # a link out
        inside / "up" / "weights.safetensors",  # a directory link out
        inside / ".." / "private" / "weights.safetensors",
        "~/weights.safetensors",  # not expanded: relative to the server's directory
    ):
        with pytest.raises(ConfigError) as e:
            reg.register("a", VectorSource("file", str(path)), "body", confine=confine)
        refusals.add(str(e.value))
    assert refusals == {
        "body.a: not under the server's vector directories; paths must lie in one of "
        "actbus.steer.vector_dirs (links followed)"
    }
    with pytest.raises(ConfigError, match="no vector files for HTTP callers"):
        reg.register("a", VectorSource("sae", str(inside), feature=0), confine=Confine(()))
    with pytest.raises(ConfigError) as e:
        reg.register("a", VectorSource("file", str(inside / "ok.safetensors")), confine=confine)
    assert "holds 2 tensors" in str(e.value) and "'v'" not in str(e.value)
    src = VectorSource("file", str(inside / "ok.safetensors"), key="v")
    assert reg.register("a", src, confine=confine).values.tolist() == [1.0] * H
    # The operator's own sources (config, Python) are not confined.
    assert reg.register("b", VectorSource("file", str(outside / "weights.safetensors"))).norm > 0
    with pytest.raises(ConfigError, match=r"vectors.c: 2 named vectors, the most .*max_named"):
        reg.register("c", [1.0] * H)
    reg.register("b", [2.0] * H)  # replacing is allowed at the cap
    with pytest.raises(ConfigError, match=r"vectors.c: has 100000 values; this model's"):
        VectorRegistry(H).register("c", [1.0] * 100_000)
    save_file({"big": torch.zeros(1024, 1024)}, str(inside / "big.safetensors"))
    old = checkpoints.MAX_TENSOR_BYTES
    checkpoints.MAX_TENSOR_BYTES = 1 << 20
    try:
        with pytest.raises(ConfigError, match=r"key: tensor 'big' is 4194304 bytes as float32"):
            reg.register(
                "b", VectorSource("file", str(inside / "big.safetensors")), confine=confine
            )
    finally:
        checkpoints.MAX_TENSOR_BYTES = old


def test_vectors_from_files_and_checkpoints(tmp_path):
    reg = VectorRegistry(H)
    save_file({"v": torch.arange(H, dtype=torch.float32)}, str(tmp_path / "one.safetensors"))
    vec = reg.register("a", VectorSource("file", str(tmp_path / "one.safetensors")))
    assert vec.values.tolist() == list(range(H)) and reg.names() == ["a"]
    save_file({"x": torch.ones(H), "y": torch.ones(3)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ConfigError, match=r"vectors.b.key: .* holds \['x', 'y'\]"):
        reg.register("b", VectorSource("file", str(tmp_path / "two.safetensors")))
    with pytest.raises(
        ConfigError, match=r"vectors\.b: has 3 values; this model's residual stream has 8"
    ):
        reg.register("b", VectorSource("file", str(tmp_path / "two.safetensors"), key="y"))
    with pytest.raises(ConfigError, match=r"vectors\.b\[0\]: expected a vector component"):
        reg.register("b", [float("inf")] * H)
    with pytest.raises(ConfigError, match="NaN or Inf"):
        reg.register("b", np.full(H, np.inf, np.float32))
    # An SAE checkpoint: the unit decoder row; a probe: its unit direction on raw inputs.
    (tmp_path / "sae").mkdir()
    w_dec = torch.randn(16, H)
    save_file({"W_dec": w_dec}, str(tmp_path / "sae" / "sae_weights.safetensors"))
    v = reg.register("f", VectorSource("sae", str(tmp_path / "sae"), feature=5))
    np.testing.assert_allclose(v.values, (w_dec[5] / w_dec[5].norm()).numpy(), rtol=1e-6)
    with pytest.raises(
        ConfigError, match=r"vectors\.g\.feature: 16 is out of range; the SAE has 16"
    ):
        reg.register("g", VectorSource("sae", str(tmp_path / "sae"), feature=16))
    (tmp_path / "probe").mkdir()
    w, inv_std = torch.randn(2, H), torch.rand(H) + 0.5
    save_file(
        {
            "linear.weight": w,
            "linear.bias": torch.zeros(2),
            "mean": torch.zeros(H),
            "inv_std": inv_std,
        },
        str(tmp_path / "probe" / "probe.safetensors"),
    )
    (tmp_path / "probe" / "probe.json").write_text('{"heads": {"happy": 0, "sad": 1}}')
    with pytest.raises(
        ConfigError, match=r"vectors.p.head: the probe has heads \['happy', 'sad'\]"
    ):
        reg.register("p", VectorSource("probe", str(tmp_path / "probe")))
    v = reg.register("p", VectorSource("probe", str(tmp_path / "probe"), head="sad"))
    d = w[1] * inv_std
    np.testing.assert_allclose(v.values, (d / d.norm()).numpy(), rtol=1e-6)
    reg.remove("p")
    with pytest.raises(ConfigError, match="no steering vector named 'p'"):
        reg.get("p", "where")


def _frontend(**kw) -> SteerFrontend:
    return SteerFrontend(
        SteerConfig.from_dict({"hooks": ["post_attn", "post_block"], **kw}),
        num_layers=4,
        hidden_size=H,
    )


def test_kv_salt_starts_at_the_first_steered_position():
    fe = _frontend()
    fe.registry.register("v", np.ones(H))

    def salt(entries, prompt_len=10):
        rs = fe.request(entries, True, "steer")
        return rs.kv_salt(prompt_len) if rs is not None else None

    base = [{"vector": "v", "layers": 1}]
    assert salt(base)[0] == 0 and salt(base) == salt([{"vector": "v", "layers": [1]}])
    assert salt(base) != salt([{"vector": "v", "layers": 1, "scale": 2.0}])
    # steering on generated tokens salts the blocks from the first generated one
    decode = salt([{"vector": "v", "layers": 1, "tier": "decode"}])
    assert decode[0] == 10 and decode != salt([{"vector": "v", "layers": 1, "tier": "decode"}], 12)
    assert salt([{"vector": "v", "layers": 1, "positions": "generated"}])[0] == 10
    assert salt([{"vector": "v", "layers": 1, "positions": [12]}])[0] == 12
    assert salt([{"vector": "v", "layers": 1, "positions": [3, 12]}])[0] == 3
    assert salt([{"vector": "v", "layers": 1, "positions": "last_prompt"}])[0] == 9
    assert salt([{"vector": "v", "layers": 1, "tier": "decode", "positions": [3]}]) is None
    # steered positions tied to the prompt's length: a longer prompt, another salt
    prefill = [{"vector": "v", "layers": 1, "tier": "prefill"}]
    assert salt(prefill)[0] == 0 and salt(prefill) != salt(prefill, 12)
    assert salt(base) == salt(base, 12)  # every position alike: shared
    # a named vector replaced: the salt follows its values, not its name
    before = salt(base)
    fe.registry.register("v", np.full(H, 2.0))
    assert salt(base) != before
    # global steering in prefill salts every request, unless it opts out
    fe.set_global([{"vector": "v", "layers": 2, "hooks": "post_attn"}])
    assert salt([]) is not None and fe.request([], False, "steer") is None
    with pytest.raises(ConfigError, match=r"actbus\.steer\.global"):
        fe.set_global([{"vector": "v", "layers": 2, "hooks": "pre_attn"}])


def test_worker_shares_rows_by_digest_and_frees_them():
    tables = SteerTables(
        torch.zeros(3, H), {(1, "post_block"): torch.zeros(16, 2, dtype=torch.int64)},
        {(1, "post_block"): torch.zeros(16, 2, 2)}, per_token=2, max_rows=16,
    )  # fmt: skip
    st = Steerer(tables)

    def wire(*digests):
        return {
            "steer": {
                "vectors": {
                    d: np.full(H, i + 1, np.float32).tobytes() for i, d in enumerate(digests)
                },
                "entries": [[1, "post_block", d, 1.0, 0.0, "base", "all"] for d in digests],
            }
        }

    st.admit(StepRequests([("a", 4, wire("x")), ("b", 4, wire("x"))], {}, set(), {}))
    assert st.rows_in_use == 1
    st.admit(StepRequests([("c", 4, wire("y", "z"))], {}, set(), {}))  # no room: not steered
    assert st.skipped == 1 and "c" not in st._reqs
    st.fill(["a", "b"], np.array([0, 2, 3]), {"a": 0, "b": 7})
    assert tables.index[(1, "post_block")][:3, 0].tolist() == [1, 1, 1]
    st.admit(StepRequests([], {}, {"a", "b"}, {}))
    assert st.rows_in_use == 0
    st.fill([], np.array([0]), {})
    assert not tables.coef[(1, "post_block")].any()


def _reference_fill(reqs, req_ids, offsets, starts, points, per_token, n):
    """Per token, in plain Python: which (slot, a, b) each point adds, in entry order."""
    want = {p: [[] for _ in range(n)] for p in points}
    for i, rid in enumerate(req_ids):
        if rid not in reqs:
            continue
        prompt_len, entries = reqs[rid]
        for t in range(offsets[i], offsets[i + 1]):
            pos = starts[rid] + t - offsets[i]
            for layer, hook, slot, a, b, tier, mode in entries:
                prompt = pos < prompt_len
                if (tier == "prefill" and not prompt) or (tier == "decode" and prompt):
                    continue
                if (mode == "prompt" and not prompt) or (mode == "generated" and prompt):
                    continue
                if mode == "last_prompt" and pos != prompt_len - 1:
                    continue
                if isinstance(mode, tuple) and pos not in mode:
                    continue
                want[(layer, hook)][t].append((slot, a, b))
    assert all(len(c) <= per_token for p in points for c in want[p])
    return want


def test_worker_fill_matches_a_per_token_reference():
    """The vectorized layout equals a plain per-token reading of every entry's tier and
    positions, over prefill chunks, decode steps and mixed batches."""
    rng = np.random.default_rng(0)
    points = [(1, "post_block"), (2, "pre_attn"), (2, "post_block")]
    k, rows = 3, 64
    tables = SteerTables(
        torch.zeros(40, H),
        {p: torch.zeros(rows, k, dtype=torch.int64) for p in points},
        {p: torch.zeros(rows, k, 2) for p in points},
        per_token=k,
        max_rows=rows,
    )
    st = Steerer(tables)
    modes = ["all", "prompt", "generated", "last_prompt", (1, 4, 9, 12)]
    tiers = ["base", "prefill", "decode"]
    new, mine = [], {}
    for r in range(8):
        digests = [f"d{r}-{j}" for j in range(2)]
        entries = []
        for _ in range(int(rng.integers(0, 4))):
            layer, hook = points[int(rng.integers(len(points)))]
            if sum(e[0] == layer and e[1] == hook for e in entries) == k:
                continue
            mode = modes[int(rng.integers(len(modes)))]
            entries.append([
                layer, hook, digests[int(rng.integers(2))], float(rng.normal()),
                float(rng.normal()), tiers[int(rng.integers(3))],
                list(mode) if isinstance(mode, tuple) else mode,
            ])  # fmt: skip
        entries.append([9, "post_block", digests[0], 1.0, 0.0, "base", "all"])  # another stage's
        vectors = {d: np.full(H, 1.0, np.float32).tobytes() for d in digests}
        new.append((f"r{r}", 6 + r, {"steer": {"vectors": vectors, "entries": entries}}))
    new.append(("plain", 5, None))
    st.admit(StepRequests(new, {}, set(), {}))
    for rid, prompt_len, wire in new:
        if wire is None:
            continue
        slots = {d: st._rows[d][0] for d in wire["steer"]["vectors"]}
        mine[rid] = (
            prompt_len,
            [
                (e[0], e[1], slots[e[2]], np.float32(e[3]), np.float32(e[4]), e[5],
                 tuple(e[6]) if isinstance(e[6], list) else e[6])
                for e in wire["steer"]["entries"] if e[0] != 9
            ],
        )  # fmt: skip
    ids = [rid for rid, _, _ in new]
    starts = {rid: 0 for rid in ids}
    for step in range(16):
        batch = [rid for rid in ids if rng.random() < 0.8] or ids[:1]
        sizes = [int(rng.integers(1, 6)) if step < 4 else 1 for _ in batch]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n = int(offsets[-1])
        st.fill(batch, offsets, dict(starts))
        want = _reference_fill(mine, batch, offsets, starts, points, k, n)
        for p in points:
            idx, coef = tables.index[p][:n], tables.coef[p][:n]
            for t in range(n):
                got = [
                    (int(idx[t, j]), float(coef[t, j, 0]), float(coef[t, j, 1]))
                    for j in range(k) if idx[t, j] != 0 or coef[t, j].any()
                ]  # fmt: skip
                assert got == [(s, float(a), float(b)) for s, a, b in want[p][t]], (step, p, t)
        for rid, size in zip(batch, sizes, strict=True):
            starts[rid] += size
    # Steady decode: the same batch several steps running (the tables are not rewritten
    # when nothing changed), then one request leaves and one is decoded alone.
    steady = [rid for rid in mine if not any(isinstance(e[6], tuple) for e in mine[rid][1])]
    steady.append("plain")
    for batch in (steady, steady, steady[::-1], steady, steady[1:], steady[1:], steady[:1]):
        offsets = np.arange(len(batch) + 1, dtype=np.int64)
        st.fill(batch, offsets, {rid: max(starts[rid], 40) for rid in batch})
        want = _reference_fill(
            mine, batch, offsets, {rid: max(starts[rid], 40) for rid in batch}, points, k,
            len(batch),
        )  # fmt: skip
        for p in points:
            for t in range(len(batch)):
                got = [
                    (int(tables.index[p][t, j]), float(tables.coef[p][t, j, 0]))
                    for j in range(k) if tables.index[p][t, j] != 0
                ]  # fmt: skip
                assert got == [(s, float(a)) for s, a, _ in want[p][t]], (batch, p, t)


def test_live_vectors_config_front_end_and_salts():
    """Live names: declared at start, apart from named vectors, sent by name (the worker
    picks the version), and prompt steering with one shares no prompt blocks."""
    cfg = CaptureConfig.from_dict(
        {"layers": [1], "steer": {"live": ["dir"]}, "control": "ipc:///tmp/actbus-x.sock"}
    )
    assert cfg.steer.live == {"dir": None} and cfg.control is not None
    with pytest.raises(ConfigError, match=r"actbus\.control: .* this engine has neither"):
        CaptureConfig.from_dict({"layers": [1], "control": "ipc:///tmp/actbus-x.sock"})
    for raw, needle in [
        ({"live": "dir"}, "actbus.steer.live: expected a list of names"),
        ({"live": {"dir": {"sae": "d"}}}, "actbus.steer.live.dir.feature"),
        (
            {"live": ["v"], "vectors": {"v": {"file": "f"}}},
            "actbus.steer.live.v: also a named vector",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            SteerConfig.from_dict(raw)
        assert needle in str(e.value), (raw, str(e.value))
    fe = _frontend(live=["dir"])
    with pytest.raises(ConfigError, match="a live vector of this engine"):
        fe.registry.register("dir", np.ones(H))
    with pytest.raises(ConfigError, match=r"no steering vector named 'dri' \(known: dir\)"):
        fe.request([{"vector": "dri", "layers": 1}], True, "steer")
    rs = fe.request([{"vector": "dir", "layers": 1, "norm_match": True, "scale": 2.0}], True, "s")
    assert rs.to_wire() == {
        "vectors": {},
        "entries": [[1, "post_block", "live:dir", 0.0, 2.0, "base", "all"]],
    }
    a, b = rs.kv_salt(10), rs.kv_salt(10)
    assert a is not None and b is not None and a != b  # this request's own blocks
    decode = fe.request([{"vector": "dir", "layers": 1, "tier": "decode"}], True, "s")
    c, d = decode.kv_salt(10), decode.kv_salt(10)
    assert c[0] == 10 and c != d  # from its first generated token on, its own


def test_worker_resolves_live_vectors_at_admission_and_keeps_the_version():
    from actbus.steer.live import LiveVectors

    tables = SteerTables(
        torch.zeros(5, H), {(1, "post_block"): torch.zeros(16, 2, dtype=torch.int64)},
        {(1, "post_block"): torch.zeros(16, 2, 2)}, per_token=2, max_rows=16,
    )  # fmt: skip
    st = Steerer(tables, live=LiveVectors({"dir": np.zeros(H, np.float32)}, H))

    def wire(norm_match: bool):
        b = 3.0 if norm_match else 0.0
        a = 0.0 if norm_match else 3.0
        entry = [1, "post_block", "live:dir", a, b, "base", "all"]
        return {"steer": {"vectors": {}, "entries": [entry]}}

    st.admit(StepRequests([("a", 4, wire(False))], {}, set(), {}))
    v2 = np.arange(H, dtype=np.float32) + 1
    assert st.push("dir", 2, v2) and not st.push("dir", 2, v2) and not st.push("x", 3, v2)
    st.admit(StepRequests([("b", 4, wire(False)), ("c", 4, wire(True))], {}, set(), {}))
    assert (st.live_versions("a"), st.live_versions("b")) == ({"dir": 1}, {"dir": 2})
    assert st.live_versions("nobody") == {}
    ra, rb, rc = (int(st._reqs[r].slot[0]) for r in "abc")
    assert ra != rb == rc and st.rows_in_use == 2  # one row per version in use
    assert not tables.table[ra].any() and torch.equal(tables.table[rb], torch.from_numpy(v2))
    norm = float(np.linalg.norm(v2.astype(np.float64)))
    assert st._reqs["c"].b[0] == np.float32(3.0 / norm) and st._reqs["c"].a[0] == 0.0
    assert st._reqs["a"].a[0] == 3.0 and st._reqs["a"].b[0] == 0.0
    st.admit(StepRequests([], {}, {"a"}, {}))  # version 1's row is freed with its last user
    assert st.rows_in_use == 1
