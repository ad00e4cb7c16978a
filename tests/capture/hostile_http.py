"""Hostile calls to ``actbus serve``'s HTTP front end: completions and chat completions
with hostile ``vllm_xargs`` (sizes, nesting, counts, types, unknown names), and the
steering endpoints (bodies too big or too deep, paths out of the vector directories,
missing keys). Each must be refused with a 4xx naming what is wrong; none may reach
the engine. A fixed list, in a fixed order (``corpus``), so a failure names its case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEEP = "[" * 100_000 + "]" * 100_000


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: bytes | None
    key: str | None = None
    """The bearer token sent (the steering endpoints' admin key, or a wrong one)."""
    headers: tuple[tuple[str, str], ...] = ()
    chunked: bool = False


def _completion(model: str, actbus, chat: bool = False, **extra) -> bytes:
    text = actbus if isinstance(actbus, str) else json.dumps(actbus)
    body = {"model": model, "max_tokens": 2, "vllm_xargs": {"actbus": text}, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    return json.dumps(body).encode()


def _steer(entries) -> dict:
    return {"steer": entries}


def xargs_corpus(hidden: int) -> list[tuple[str, object]]:
    """(name, the actbus entry: JSON text, or a value to encode) of hostile selections."""
    e = {"vector": "nope", "layers": 1}
    return [
        ("deep array", DEEP),
        ("deep map", '{"tags":' * 50_000 + "1" + "}" * 50_000),
        ("deep tags", {"tags": {"k": json.loads("[" * 20 + "]" * 20)}}),
        ("5 MB of text", "x" * (5 << 20)),
        ("not json", "{not json"),
        ("a number", "7"),
        ("a string", '"layers"'),
        ("unknown key", {"colour": 1}),
        ("return not true or fetch", {"layers": [3], "return": "yes"}),
        ("layer out of range", {"layers": [999]}),
        ("negative layer", {"layers": [-1]}),
        ("bool layer", {"layers": [True]}),
        ("100k layers", {"layers": list(range(100_000))}),
        ("tags 5000 keys", {"tags": {f"k{i}": i for i in range(5000)}}),
        ("tags bytes-like", {"tags": ["a"]}),
        ("positions mode", {"positions": "middle"}),
        ("100k steering entries", _steer([e] * 100_000)),
        ("65 entries", _steer([{"vector": [0.5] * hidden, "layers": 1}] * 65)),
        (
            "expands past 64",
            _steer([{"vector": "v", "layers": [1, 2], "hooks": ["post_block"] * 3}] * 40),
        ),
        ("100k steer layers", _steer([{"vector": "v", "layers": list(range(100_000))}])),
        ("500k-wide vector", _steer([{"vector": [0.5] * 500_000, "layers": 1}])),
        ("narrow vector", _steer([{"vector": [0.5] * 3, "layers": 1}])),
        ("nan vector", '{"steer": [{"vector": [NaN, 1], "layers": 1}]}'),
        ("inf scale", '{"steer": [{"vector": "v", "layers": 1, "scale": Infinity}]}'),
        ("unknown vector", _steer([e])),
        ("unsteerable layer", _steer([{"vector": "v", "layers": 3}])),
        ("steer not a list", _steer("all")),
        ("steer entry not a map", _steer([1, 2])),
        ("steer_global not a bool", {"steer_global": "no"}),
        ("gate unknown monitor", _steer([{**e, "gate": {"monitor": "x", "threshold": 0}}])),
        ("unknown monitor", {"monitor": ["nope"], "monitor_return": True}),
        ("monitor not a list", {"monitor": 5}),
        ("monitor_return not a bool", {"monitor": ["drift"], "monitor_return": "yes"}),
    ]


def number_cases(hidden: int) -> list[tuple[str, object, str]]:
    """Numbers that fit Python but not the type they become (int32 positions, float32
    scales and thresholds), in entries otherwise valid, with the field the refusal
    names: (name, the request's actbus: a value, or JSON text, field). Before the
    boundary checked them, a position past int64 killed the engine (HTTP 500) and the
    rest were accepted."""
    v = [0.25] * hidden
    w = "extra_args.actbus"
    return [
        ("capture position past int32", {"layers": [3], "positions": [1 << 40]},
         f"{w}.positions[0]"),
        ("capture position past int64", {"layers": [3], "positions": [1 << 63]},
         f"{w}.positions[0]"),
        ("steer position past int32", _steer([{"vector": v, "layers": 1, "positions": [1 << 33]}]),
         f"{w}.steer[0].positions[0]"),
        ("scale past float32", _steer([{"vector": v, "layers": 1, "scale": 1e39}]),
         f"{w}.steer[0].scale"),
        ("threshold past float32", _steer([{"vector": v, "layers": 2,
                                            "gate": {"monitor": "gate", "threshold": 1e39}}]),
         f"{w}.steer[0].gate.threshold"),
        # Issue 45: 1.9M positions (3.6 MiB) were each checked on the event loop (a
        # second); a 5000-digit integer, past Python's int parsing, was an HTTP 500.
        ("1.9M capture positions", {"layers": [3], "positions": [0] * 1_900_000},
         f"{w}.positions: a list of 1900000 items, more than the 65536"),
        ("a 5000-digit layer", '{"layers": [' + "7" * 5000 + "]}",
         f"{w}: an integer of 5000 digits at column 13"),
    ]  # fmt: skip


OUTSIDE = (
    "/etc/passwd",
    "a missing file outside",
    "the model's weights by a link",
    "out by a directory link",
    "out by ..",
    "home",
)
"""The steering cases of files outside the vector directory: one refusal for all."""


def corpus(model: str, hidden: int, vectors: Path, admin: str) -> list[Case]:
    """Every hostile call, in order."""
    out = []
    for name, actbus in xargs_corpus(hidden):
        out.append(
            Case(f"completion: {name}", "POST", "/v1/completions", _completion(model, actbus))
        )
    for name, actbus in xargs_corpus(hidden)[::2]:
        out.append(
            Case(f"chat: {name}", "POST", "/v1/chat/completions", _completion(model, actbus, True))
        )
    # cmpl-ID-0 fits the wire (4092 characters), vLLM's own id (9 more) would not.
    long_id = (("X-Request-Id", "r" * 4085),)
    out += [
        Case("completion: deep body", "POST", "/v1/completions", DEEP.encode()),
        Case("completion: body not utf-8", "POST", "/v1/completions", b"\xff\xfe{"),
        Case(
            "completion: a returned request's id past the wire's bound",
            "POST", "/v1/completions",
            _completion(model, {"monitor": ["drift"], "monitor_return": True}),
            headers=long_id,
        ),
        Case(
            "completion: actbus as a list",
            "POST", "/v1/completions",
            json.dumps({"model": model, "prompt": [5], "max_tokens": 2,
                        "vllm_xargs": {"actbus": [1, 2]}}).encode(),
        ),
    ]  # fmt: skip

    def put(name: str, path: str, body, key: str | None = admin, **kw) -> Case:
        raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        return Case(f"steering: {name}", "PUT", f"/v1/actbus/{path}", raw, key, **kw)

    good = str(vectors / "good.safetensors")
    out += [
        put("no key", "vectors/x", {"values": [0.5] * hidden}, key=None),
        put("the completion key", "vectors/x", {"values": [0.5] * hidden}, key="x"),
        put("a wrong key", "steer/global", {"entries": []}, key=admin + "x"),
        Case("steering: list without a key", "GET", "/v1/actbus/vectors", None),
        put("deep body", "vectors/x", DEEP.encode()),
        put("9 MB body", "vectors/x", b"[" + b"0," * (9 << 19) + b"0]"),
        put("9 MB chunked body", "vectors/x", b" " * (9 << 20), chunked=True),
        put("not json", "vectors/x", b"{values"),
        put("not utf-8", "vectors/x", b"\xff\xfe"),
        put("1M values", "vectors/x", {"values": [0.5] * 1_000_000}),
        put("values not a list", "vectors/x", {"values": "abc"}),
        put("nan values", "vectors/x", b'{"values": [NaN' + b", 1" * (hidden - 1) + b"]}"),
        put("values and more", "vectors/x", {"values": [1.0] * hidden, "file": good}),
        put("a 300-character name", "vectors/" + "n" * 300, {"values": [0.5] * hidden}),
        put("/etc/passwd", "vectors/x", {"file": "/etc/passwd"}),
        put("a missing file outside", "vectors/x", {"file": "/nonexistent/x.safetensors"}),
        put(
            "the model's weights by a link",
            "vectors/x",
            {"file": str(vectors / "weights.safetensors")},
        ),
        put("out by a directory link", "vectors/x", {"file": str(vectors / "up" / "server.log")}),
        put("out by ..", "vectors/x", {"file": str(vectors / ".." / "server.log")}),
        put("home", "vectors/x", {"file": "~/.bashrc"}),
        put("an sae at /", "vectors/x", {"sae": "/", "feature": 0}),
        put("a probe at /", "vectors/x", {"probe": "/"}),
        put("a missing key inside", "vectors/x", {"file": good, "key": "nope"}),
        put("an sae inside without weights", "vectors/x", {"sae": str(vectors), "feature": 0}),
        put("two sources", "vectors/x", {"file": good, "sae": str(vectors)}),
        put("global not entries", "steer/global", {"other": 1}),
        put("global 65 entries", "steer/global", {"entries": [{"vector": "v", "layers": 1}] * 65}),
        put(
            "global unknown vector", "steer/global", {"entries": [{"vector": "nope", "layers": 1}]}
        ),
        put(
            "global 100k entries",
            "steer/global",
            {"entries": [{"vector": "v", "layers": 1}] * 100_000},
        ),
        Case("steering: delete a missing name", "DELETE", "/v1/actbus/vectors/nope", None, admin),
        Case("steering: no such endpoint", "GET", "/v1/actbus/vectors/x", None, admin),
        Case("steering: post global", "POST", "/v1/actbus/steer/global", b"{}", admin),
    ]
    return out
