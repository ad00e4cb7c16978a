"""replace, ablate and clamp without an engine: the engine's ``ops``, entries' checks,
the front end's resolution (orthonormal directions, an SAE latent read as slices and
confined for HTTP callers), per-token counting and cache salts."""

from __future__ import annotations

import numpy as np
import pytest

from actbus.errors import ConfigError
from actbus.steer.config import SteerConfig, parse_steer
from actbus.steer.frontend import SteerFrontend
from tests.support.steer_oracle import write_sae

H = 8


def _front(**cfg) -> SteerFrontend:
    raw = {"hooks": ["pre_attn", "post_block"], "ops": ["replace", "ablate", "clamp"], **cfg}
    return SteerFrontend(SteerConfig.from_dict(raw), num_layers=4, hidden_size=H, max_len=64)


def _sae(path, arch="jumprelu", d_sae=32):
    return write_sae(path, H, d_sae, seed=0, arch=arch)


def test_engine_ops_and_what_an_engine_without_them_refuses():
    assert SteerConfig.from_dict({}).ops == ("add",)
    assert SteerConfig.from_dict({"ops": ["clamp", "replace"]}).ops == ("add", "replace", "clamp")
    with pytest.raises(ConfigError, match=r"actbus.steer.ops: expected a list of operations"):
        SteerConfig.from_dict({"ops": ["patch"]})
    entry = [{"op": "replace", "layers": 1, "vector": [0.0] * H}]
    with pytest.raises(ConfigError, match=r"s\[0\].op: this engine does not replace; list it"):
        parse_steer(entry, "s", ops=("add",))
    assert parse_steer(entry, "s", ops=("add", "replace"))[0].op == "replace"


def test_rows_pair_with_positions_and_count_per_token():
    f = _front(per_token=2)
    rows = np.arange(3 * H, dtype=np.float32).reshape(3, H)
    e = {"op": "replace", "layers": 1, "positions": [9, 2, 5], "rows": rows}
    steer = f.request([e], True, "s")
    got = {r.spec.positions: r.vector.values.tolist() for r in steer.entries}
    assert got == {(9,): rows[0].tolist(), (2,): rows[1].tolist(), (5,): rows[2].tolist()}
    # three rows at one point, one per position: within per_token=2; an add on every
    # token beside them makes 2; a second add makes 3
    add = {"vector": [1.0] * H, "layers": 1}
    f.request([e, add], True, "s")
    with pytest.raises(ConfigError, match=r"3 vectors at layer 1 post_block"):
        f.request([e, add, add], True, "s")
    with pytest.raises(ConfigError, match=r"s\[0\].positions: a position is listed twice"):
        f.request([{**e, "positions": [1, 1, 2]}], True, "s")
    with pytest.raises(ConfigError, match=r"give exactly one of 'vector'"):
        f.request([{**e, "vector": [0.0] * H}], True, "s")


def test_errors_name_the_entry_and_key_the_values_came_from():
    """Issue 50: a wrong-width row of a ``replace`` was reported as ``steer[0].vector``,
    and a request's errors named the expanded spec's index, not the entry's."""
    f = _front()
    e = {"op": "replace", "layers": 1, "positions": [0, 1], "rows": [[0.0] * H, [1.0, 2.0]]}
    with pytest.raises(ConfigError, match=r"^s\[0\]\.rows\[1\]: has 2 values; .* has 8$"):
        f.request([e], True, "s")
    with pytest.raises(ConfigError, match=r"^s\[0\]\.directions\[0\]: has 3 values"):
        f.request([{"op": "ablate", "layers": 1, "directions": [[1.0, 2.0, 3.0]]}], True, "s")
    # entry 0 expands to four specs; entry 1's unknown names are entry 1's
    wide = {"vector": [1.0] * H, "layers": [0, 1], "hooks": ["pre_attn", "post_block"]}
    with pytest.raises(ConfigError, match=r"^s\[1\]\.vector: no steering vector named 'nope'"):
        f.request([wide, {"vector": "nope", "layers": 1}], True, "s")
    rows = {"op": "replace", "layers": 1, "positions": [0, 1], "rows": [[0.0] * H, "nope"]}
    with pytest.raises(ConfigError, match=r"^s\[1\]\.rows\[1\]: no steering vector named"):
        f.request([wide, rows], True, "s")


def test_ablate_directions_are_orthonormalized():
    f = _front()
    d = np.random.default_rng(0).normal(size=(3, H))
    steer = f.request([{"op": "ablate", "layers": [1, 2], "directions": d.tolist()}], True, "s")
    assert len(steer.entries) == 6  # 3 directions x 2 layers
    q = np.stack([r.vector.values for r in steer.entries if r.spec.layer == 1])
    np.testing.assert_allclose(q @ q.T, np.eye(3), atol=1e-5)
    p = q.T @ q  # their projections add up to the projection on the span of d
    np.testing.assert_allclose(p, d.T @ np.linalg.pinv(d.T), atol=1e-5)
    assert all(r.read is r.vector and r.terms[0] == -1.0 for r in steer.entries)


def test_clamp_reads_one_latent_and_confines_http_callers(tmp_path):
    (tmp_path / "dirs").mkdir()
    t = _sae(tmp_path / "dirs" / "sae")
    f = _front(vector_dirs=[str(tmp_path / "dirs")])
    e = {"op": "clamp", "layers": 1, "sae": str(tmp_path / "dirs" / "sae"), "feature": 5}
    steer = f.request([{**e, "value": 2.5}], True, "s")  # an HTTP caller, inside its dirs
    (r,) = steer.entries
    np.testing.assert_allclose(r.vector.values, t["W_dec"][5].numpy())
    np.testing.assert_allclose(r.read.values, t["W_enc"][:, 5].numpy())
    bias = float(t["b_enc"][5] - t["b_dec"] @ t["W_enc"][:, 5])
    assert r.coef == (2.5, 0.0)
    assert r.terms[1:4] == pytest.approx((-1.0, bias, float(t["threshold"][5])), rel=1e-5)
    # outside the dirs: refused to HTTP callers (requests and global entries), read for
    # in-process ones
    _sae(tmp_path / "private")
    out = {**e, "sae": str(tmp_path / "private"), "value": 1.0}
    with pytest.raises(ConfigError, match="not under the server's vector directories"):
        f.request([out], True, "s")
    with pytest.raises(ConfigError, match="not under the server's vector directories"):
        f.set_global([out], trusted=False)
    assert f.request([out], True, "s", trusted=True).entries[0].read is not None
    with pytest.raises(ConfigError, match=r"feature: 99 is out of range; the SAE has 32"):
        f.request([{**out, "feature": 99}], True, "s", trusted=True)
    _sae(tmp_path / "topk", arch="topk")
    with pytest.raises(
        ConfigError, match="architecture 'topk' cannot be clamped one latent at a time"
    ):
        f.request([{**out, "sae": str(tmp_path / "topk")}], True, "s", trusted=True)


def test_ops_salt_the_blocks_from_their_first_position():
    f = _front()
    row = {"op": "replace", "layers": 1, "positions": [3], "rows": [[0.5] * H]}
    other = {**row, "rows": [[0.25] * H]}
    decode = {"op": "ablate", "layers": 1, "tier": "decode", "directions": [1.0, *[0.0] * 7]}

    def salt(*entries):
        return f.request(list(entries), True, "s").kv_salt(prompt_len=10)

    assert salt(row) is not None and salt(row) == salt(row)
    assert salt(row) != salt(other)
    assert salt(row)[0] == 3 and salt(decode)[0] == 10
    assert salt({**row, "positions": [12]})[0] == 12  # a generated position
