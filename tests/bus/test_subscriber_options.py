"""Options written once: the subscriber flags every command shares, and flags made from
dataclass fields (their docstrings are the help)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, fields

import pytest

from actbus.bus.options import SubscriberOptions
from actbus.bus.protocol import Subscription
from actbus.errors import ConfigError
from actbus.flags import HelpFormatter, add_fields, field_docs, flag, name_flag, values
from trainers.cli import MODEL_FROM_SOURCE, _probe_parser, _sae_parser
from trainers.config import ProbeConfig, SAEConfig


def _parse(*argv: str, **kw) -> SubscriberOptions:
    p = argparse.ArgumentParser(prog="t", formatter_class=HelpFormatter)
    SubscriberOptions.add_arguments(p, **kw)
    return SubscriberOptions.from_args(p.parse_args(argv))


def test_flags_make_the_subscription(tmp_path):
    o = _parse(
        "--connect", f"ipc://{tmp_path}/bus.sock", "--policy", "spill:64:drop_oldest",
        "--window", "8", "--window-mb", "0.5", "--group", "ranks", "--name", "me",
        "--match", "split=train", "--match", "split=dev", "--match", "n=3",
        "--layer", "3,1,3", "--hook", "post_block",
    )  # fmt: skip
    s = o.subscription()
    assert (s.policy, s.spill_mb, s.spill_fallback) == ("spill", 64.0, "drop_oldest")
    assert (s.window, s.window_bytes, s.group, s.name) == (8, 1 << 19, "ranks", "me")
    assert s.layers == (1, 3) and s.hooks == ("post_block",)
    assert o.match == {"split": ["train", "dev"], "n": 3}  # a number is a number
    assert Subscription.from_wire(s.to_wire()) == s  # the publisher accepts it as sent


def test_match_values_keep_their_type():
    o = _parse("--connect", "ipc:///tmp/x", "--match", "a=1", "--match", "a=true",
               "--match", 'b="2"', "--match", "c=x=y")  # fmt: skip
    assert o.match == {"a": [1, True], "b": "2", "c": "x=y"}


def test_tags_is_the_deprecated_spelling_of_match(caplog):
    with caplog.at_level(logging.WARNING, logger="actbus.options"):
        o = _parse("--connect", "ipc:///tmp/x", "--tags", '{"lang": ["en", "fr"]}')
    assert o.match == {"lang": ["en", "fr"]}
    assert "--tags is deprecated" in caplog.text and "--match KEY=VALUE" in caplog.text
    with pytest.raises(ConfigError, match="--tags: give --match only"):
        _parse("--connect", "ipc:///tmp/x", "--tags", '{"a": 1}', "--match", "a=1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--connect", "tcp://nowhere"], "--connect='tcp://nowhere': not a ZeroMQ address"),
        (["--policy", "newest"], "--policy: unknown policy 'newest'"),
        (["--window", "0"], "--window must be at least 1"),
        (["--window-mb", "0"], "--window-mb must be above 0"),
        (["--layer", "-1"], "--layers[0]: expected a 0-based layer index"),
        (["--hook", "resid"], "--hooks[0]: unknown hook 'resid'"),
        (["--group", "g" * 201], "--group: at most 200 characters"),
        (["--server-key", "/nonexistent"], "--client-secret-key: required with --server-key"),
    ],
)
def test_a_bad_option_is_named(argv, message):
    if argv[0] != "--connect":
        argv = ["--connect", "ipc:///tmp/x", *argv]
    with pytest.raises(ConfigError) as e:
        _parse(*argv)
    assert message in str(e.value)


def test_a_bad_option_ends_the_command_with_its_usage(capsys):
    p = argparse.ArgumentParser(prog="actbus t")
    SubscriberOptions.add_arguments(p)
    with pytest.raises(SystemExit) as e:
        SubscriberOptions.from_args(p.parse_args(["--connect", "ipc:///x", "--window", "0"]), p)
    assert e.value.code == 2
    assert "actbus t: error: --window must be at least 1" in capsys.readouterr().err


def test_only_the_fields_a_command_added_are_read():
    """A consumer's own ``--layers`` (the fs sink's selection) is not the subscriber's."""
    p = argparse.ArgumentParser()
    SubscriberOptions.add_arguments(p, exclude=("layers", "hooks"))
    p.add_argument("--layers", default="0,3")
    o = SubscriberOptions.from_args(p.parse_args(["--connect", "ipc:///x"]))
    assert o.layers is None


def test_help_shows_each_option_with_its_default():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    SubscriberOptions.add_arguments(p, defaults={"policy": "sample:5/s"})
    text = " ".join(p.format_help().split())
    docs = field_docs(SubscriberOptions)
    for f in fields(SubscriberOptions):
        assert docs[f.name] and docs[f.name][:40] in text, f.name
    assert "(default: sample:5/s)" in text and "(default: 64)" in text
    assert "--tags" not in text  # accepted, not advertised


@dataclass
class _Config:
    width: int = 8
    """How wide."""
    kinds: tuple[str, ...] = ("a",)
    """Which kinds."""
    rate: float = field(default=0.5, metadata=flag(sweep=True))
    """How fast; 100 % is all."""
    fast: bool = True
    """Go fast."""
    mode: str = field(default="x", metadata=flag(choices=("x", "y")))

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width: expected >= 1, got {self.width}")


def test_a_field_is_a_flag():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_fields(p, _Config)
    ns = p.parse_args(["--width", "3", "--kinds", "a,b", "--rate", "0.1,0.2", "--no-fast"])
    assert values(ns, _Config) == {
        "width": 3, "kinds": ("a", "b"), "rate": [0.1, 0.2], "fast": False, "mode": "x",
    }  # fmt: skip
    assert values(p.parse_args([]), _Config)["rate"] == [0.5]
    text = " ".join(p.format_help().split())
    assert "--width WIDTH How wide. (default: 8)" in text
    assert "--no-fast turn off: go fast." in text and "100 % is all" in text
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "z"])
    with pytest.raises(ValueError) as e:
        _Config(width=0)
    assert name_flag(p, str(e.value)) == "--width: expected >= 1, got 0"


@pytest.mark.parametrize(
    ("parser", "config", "renamed"),
    [(_sae_parser, SAEConfig, ("k", "--k")), (_probe_parser, ProbeConfig, ("labels", "--label"))],
)
def test_every_model_field_is_a_trainer_flag_with_its_help(parser, config, renamed):
    p = parser()
    actions = {a.dest: a for a in p._actions}
    docs = field_docs(config)
    for f in fields(config):
        if f.name in MODEL_FROM_SOURCE:
            continue
        assert f.name in actions, f"{config.__name__}.{f.name} has no flag"
        assert docs.get(f.name), f"{config.__name__}.{f.name} has no docstring (its help)"
    assert actions[renamed[0]].option_strings == [renamed[1]]
