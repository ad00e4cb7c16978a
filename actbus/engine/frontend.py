"""Front-end side of capture: check each request's selection before it is queued.

vLLM turns every request into an engine request in ``InputProcessor.process_inputs``
(offline ``LLM``, ``AsyncLLM`` and the OpenAI server alike). Wrapping it gives one
place to fail a bad ``extra_args["actbus"]`` for that request alone (a ValueError,
which the OpenAI server answers with HTTP 400), and to write the normalized
selection into the engine's private copy of the params, with what the worker
cannot know by itself: the caller's request id and ``n``. Requests whose
selection needs prompt positions skip *reading* the prefix cache, so those
positions are computed, not silently missing; other requests keep the cache.

A request reaching an engine that vLLM's servers made (any route: ``actbus.engine.trust``),
or sent as JSON text (``vllm_xargs``), is an HTTP caller's. Its selection may ask
for ``"return": true`` (rows in each choice) or ``"return": "fetch"`` (rows kept for
``GET /v1/actbus/returns/ID``); what it may get back is bounded before it is queued
(``actbus.capture.http``), and ``actbus.engine.responses`` writes the rows into the
response's choices.

Requests with ``"return": true`` are registered with the front end's
``ReturnCollector``; ``RequestState._new_completion_output`` (where every output
of the V1 output processor is made, offline and streaming alike) is wrapped to
attach their rows as ``CompletionOutput.activations`` (a streamed HTTP call's, with
its rows inline: a ``Due`` its chunk takes them with, ``actbus.capture.returns``).
Requests with ``"monitor_return": true`` are registered the same way with the
front end's ``ScoreCollector`` (``actbus.monitor.returns``), and their outputs carry
``CompletionOutput.monitor_scores``; over HTTP ``actbus.engine.responses`` writes them
into the response's choices.

Monitors (``"monitor"``, ``"monitor_global"``: ``actbus.monitor.frontend``) are
resolved here as well; a monitored request scores every prompt token, so it skips
reading the prefix cache. Steering (``extra_args["actbus"]["steer"]`` and
``"steer_global"``) is resolved here too (``actbus.steer.frontend``) and travels in
the same normalized entry; the blocks holding a steered request's steered KV get a
salt derived from that steering (``actbus.engine.kvsalt``).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from actbus.capture import calls
from actbus.capture.http import Ticket, parse_return, row_bytes
from actbus.capture.http import for_config as http_for_config
from actbus.capture.selection import Selection, parse_selection
from actbus.config import check_request_id
from actbus.engine import closing, trust
from actbus.errors import ConfigError
from actbus.hooks import cache_salt as hooks_salt
from actbus.hooks import take_hooks
from actbus.hooks import to_wire as hooks_wire
from actbus.jsontext import parse_json_text
from actbus.monitor.frontend import take_monitors
from actbus.steer.frontend import RequestSteer

KEY = "actbus"
XARGS_HINT = "; over HTTP send the selection as a JSON string: vllm_xargs={'actbus': '{...}'}"
ENGINE_ID_ROOM = 32
"""Characters vLLM's own id of a request adds to its caller's (``-`` and 8 hex digits,
``{index}_`` for a sample of ``n > 1``): a returned request's id keeps this room."""
log = logging.getLogger("actbus")


def patch() -> bool:
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        return False
    if getattr(InputProcessor, "_actbus_patched", False):
        return True
    InputProcessor.process_inputs = _wrap_process_inputs(InputProcessor.process_inputs)
    InputProcessor._actbus_patched = True
    trust.patch()
    try:
        from vllm.v1.engine.core_client import InprocClient, MPClient
    except ImportError:
        pass
    else:
        MPClient.shutdown = _wrap_shutdown(MPClient.shutdown)
        InprocClient.__init__ = _wrap_inproc_init(InprocClient.__init__)
        InprocClient.get_output = _wrap_inproc_get_output(InprocClient.get_output)
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        pass
    else:
        AsyncLLM.shutdown = _wrap_async_shutdown(AsyncLLM.shutdown)
        logging.getLogger(ASYNC_LLM_LOGGER).addFilter(_EndOfOutputs())
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        pass
    else:
        EngineCore.shutdown = _wrap_core_shutdown(EngineCore.shutdown)
    try:
        from vllm.v1.engine.output_processor import RequestState
    except ImportError:
        return True  # selections still work; "return" is refused per request below
    from vllm.outputs import RequestOutput

    RequestState._new_completion_output = _wrap_completion_output(
        RequestState._new_completion_output
    )
    RequestOutput.add = _wrap_add(RequestOutput.add)
    RequestState._actbus_returns = True
    try:
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError:
        pass
    else:
        OutputProcessor.abort_requests = _wrap_abort(OutputProcessor.abort_requests)
        OutputProcessor.add_request = _wrap_add_request(OutputProcessor.add_request)
    from actbus.engine import responses

    responses.patch()
    return True


_IN_PROCESS: set[str] = set()
"""The engines (``closing.key``) whose engine core runs in this process."""


def _wrap_inproc_init(orig):
    """Remember that this engine's core runs in the caller's process (vLLM reads
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` once, when the engine is made: its value at a
    request's time says nothing)."""

    @functools.wraps(orig)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, vllm_config, *args, **kwargs)
        _IN_PROCESS.add(closing.key(vllm_config))

    return __init__


def _wrap_inproc_get_output(orig):
    """An engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    steps once more when its last requests have just finished.

    The workers learn which requests finished from the next step's scheduler output,
    and that is when capture publishes their ends. A separate engine core process runs
    that step by itself (its loop runs while the scheduler holds finished requests
    too); the in-process client stops as soon as no request is unfinished, so the last
    requests' ends would wait for the next ``generate``, and a subscriber for them."""

    @functools.wraps(orig)
    def get_output(self: Any):
        out = orig(self)
        sched = getattr(getattr(self, "engine_core", None), "scheduler", None)
        if sched is None or sched.has_unfinished_requests() or not sched.has_finished_requests():
            return out
        more, executed = self.engine_core.step_fn()
        self.engine_core.post_step(model_executed=executed)
        extra = more.get(0) if more else None
        if extra is not None and extra.outputs:  # none expected: every request had ended
            out.outputs.extend(extra.outputs)
        return out

    return get_output


def _wrap_core_shutdown(orig):
    """The engine core's shutdown closes what actbus opened for it in this process
    (``actbus.engine.closing``): an engine core in the caller's process then ends its
    subscribers' stream as its shutdown returns, not when the process exits."""

    @functools.wraps(orig)
    def shutdown(self: Any, *args: Any, **kwargs: Any):
        try:
            return orig(self, *args, **kwargs)
        finally:
            vllm_config = getattr(self, "vllm_config", None)
            closing.shut_down(vllm_config)
            _IN_PROCESS.discard(closing.key(vllm_config))
            ends = _publishers(vllm_config)
            if ends is not None:  # this process's front end stops reading them
                _close_collectors(ends[1])

    return shutdown


def _wrap_shutdown(orig):
    @functools.wraps(orig)
    def shutdown(self, *args: Any, **kwargs: Any):
        try:
            return orig(self, *args, **kwargs)
        finally:
            if not getattr(self, "_actbus_farewell", False):
                self._actbus_farewell = True
                _farewell(getattr(self, "vllm_config", None))

    return shutdown


ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"
_STOPPING = threading.Event()
"""Set once an ``AsyncLLM`` of this process was asked to shut down."""


class _EndOfOutputs(logging.Filter):
    """``AsyncLLM.shutdown`` stops its engine client, which closes the output socket,
    then cancels the output handler: in between, the handler reads the closed socket as
    ``EngineDeadError`` and logs "output_handler failed" as an ERROR with a traceback,
    on every clean stop (issue 50: each SIGTERM of ``actbus serve``). Once a shutdown
    was asked for, that record is what it is, the end of the outputs, and becomes one
    INFO line; the error itself still reaches any request in flight, as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (
            _STOPPING.is_set()
            and record.levelno >= logging.ERROR
            and "output_handler failed" in str(record.msg)
            and type(exc).__name__ == "EngineDeadError"
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = "[shutdown] AsyncLLM: outputs ended with the engine", ()
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _wrap_async_shutdown(orig):
    @functools.wraps(orig)
    def shutdown(self, *args: Any, **kwargs: Any):
        _STOPPING.set()  # before the engine client stops: see _EndOfOutputs
        return orig(self, *args, **kwargs)

    return shutdown


def _farewell(vllm_config: Any) -> None:
    """END for the subscribers of an engine whose shutdown killed its workers before
    their publisher could say it (vLLM 0.26 stops its engine core with SIGTERM and
    no grace): trainers and ``--exit-on-end`` consumers would wait forever. A
    publisher that ended cleanly removed its ``ipc://`` socket file: nothing to do.
    Under data parallelism, for each rank whose engine core runs on this node (those
    of other nodes are their own node's to end)."""
    ends = _publishers(vllm_config)
    if ends is None:
        return
    cfg, addresses = ends
    from actbus.bus.farewell import announce_end_all

    _close_collectors(addresses)
    told = announce_end_all(
        [a for a in addresses if not _cleanly_gone(a)],
        reason="the engine stopped",
        server_secret_key=cfg.server_secret_key,
        authorized_keys=cfg.authorized_keys,
        insecure_allow_any_interface=cfg.insecure_allow_any_interface,
    )
    if told:
        log.info("actbus: the engine stopped before its publisher; told %d subscribers", told)


def _publishers(vllm_config: Any) -> tuple[Any, list[str]] | None:
    """The engine's capture config and the addresses its publishers bind on this node
    (a rank each under data parallelism); None where it publishes nothing."""
    if vllm_config is None:
        return None
    try:
        from actbus.engine.session import _checked

        checked = _checked(vllm_config)
    except Exception:  # a config refused at start: no publisher ever ran
        return None
    if checked is None or not checked[0].publish:
        return None
    from actbus.engine.dataparallel import of_config

    cfg = checked[0]
    return cfg, [cfg.publish_address(r) for r in of_config(vllm_config).local]


def _close_collectors(addresses: list[str]) -> None:
    """The front end's readers of returned rows and scores stop reading ``addresses``."""
    for name in ("actbus.capture.returns", "actbus.monitor.returns"):
        returns = sys.modules.get(name)  # loaded once a request returned
        if returns is not None:
            returns.close_collectors(addresses)


def _cleanly_gone(address: str) -> bool:
    """An ``ipc://`` publisher that ended cleanly removed its socket file."""
    path = address.removeprefix("ipc://")
    return path != address and not path.startswith("@") and not os.path.exists(path)


@dataclass(frozen=True)
class RequestAsk:
    """What one request asks of the engine, from its ``extra_args.actbus``, checked."""

    selection: Selection | None
    """Its capture selection (the engine's own under ``requests: all``), or None."""
    steer: RequestSteer | None
    """Its whole steering, global entries included, or None: the engine does not steer."""
    monitors: tuple[str, ...]
    """Its monitors, global ones included."""
    scores_back: bool
    """Whether its monitor scores come back with its output."""
    http_mode: str | None
    """How its rows go back over HTTP: "inline" or "fetch"; None when not over HTTP or
    not returned."""
    hooks: list | None
    """Its user hooks (``user_hooks``), or None."""


NOTHING_ASKED = RequestAsk(None, None, (), False, None, None)


class _Frontend:
    """What the front end needs of the engine's capture config, parsed once."""

    def __init__(self, vllm_config: Any) -> None:
        from actbus.engine.session import _checked, num_layers, steer_frontend

        checked = _checked(vllm_config)
        self.active = checked is not None
        if not self.active:
            return
        cfg, layers = checked
        self.cfg = cfg
        from actbus.engine.dataparallel import of_config

        self.dp = of_config(vllm_config)
        self.requests = cfg.requests
        self.num_layers = num_layers(vllm_config.model_config)
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.base = Selection(layers, cfg.hooks, cfg.positions, cfg.tags)
        self.steer = steer_frontend(cfg, vllm_config)
        self.vllm_config = vllm_config
        self.row_bytes: int | None = None  # a returned row's bytes, once asked over HTTP
        # Its one worker in this process: a request's Hook objects can run there.
        self.in_process = (
            closing.key(vllm_config) in _IN_PROCESS
            and int(vllm_config.parallel_config.world_size) == 1
        )

    def parse(self, params: Any, trusted: bool = False) -> RequestAsk:
        """What the request's ``extra_args.actbus`` asks of the engine, checked.
        ``trusted``: the engine is an in-process Python caller's (``actbus.engine.trust``)
        and the entry is not JSON text; anything else is checked as an HTTP caller's:
        path sources confined, returned rows bounded, no ``Hook`` objects."""
        extra = getattr(params, "extra_args", None) or {}
        raw = extra.get(KEY) if isinstance(extra, dict) else None
        if isinstance(raw, str):  # over HTTP: vllm_xargs={"actbus": "<json>"}
            raw = parse_json_text(raw, "extra_args.actbus", hint=XARGS_HINT)
            trusted = False
        over_http = not trusted
        http_mode = None
        if over_http and isinstance(raw, dict) and "return" in raw:
            raw = dict(raw)
            raw["return"], http_mode = parse_return(raw["return"])
        raw, monitors, scores_back = take_monitors(raw, self.cfg.monitor)
        raw, hooks = take_hooks(
            raw, self.cfg.user_hooks, over_http=over_http, in_process=self.in_process
        )
        steer_raw, use_global = None, True
        if isinstance(raw, dict) and ("steer" in raw or "steer_global" in raw):
            raw = dict(raw)
            steer_raw, use_global = raw.pop("steer", None), raw.pop("steer_global", True)
            if not raw:  # steering alone: captured as a request without a selection
                raw = None
            if self.steer is None:
                raise ConfigError(
                    "extra_args.actbus.steer: this engine does not steer; add a 'steer' "
                    "entry to its actbus config"
                )
        steer = (
            self.steer.request(
                steer_raw, use_global, "extra_args.actbus.steer", trusted=not over_http
            )
            if self.steer is not None
            else None
        )
        ask = RequestAsk(None, steer, monitors, scores_back, None, hooks)
        if raw is False:  # opts this request out of ``requests: all``
            return ask
        if raw is None:
            return replace(ask, selection=self.base if self.requests == "all" else None)
        sel = parse_selection(
            raw,
            engine_layers=self.base.layers,
            engine_hooks=self.base.hooks,
            num_layers=self.num_layers,
            base=self.base,
            max_len=self.max_len,
        )
        return replace(ask, selection=sel, http_mode=http_mode if sel.returns else None)

    def admit_http(self, sel: Selection, request: Any, sp: Any, fetch: bool) -> Ticket:
        """Reserve what an HTTP request's rows may take, or refuse it naming the limit."""
        if self.row_bytes is None:
            mc = self.vllm_config.model_config
            self.row_bytes = row_bytes(mc.get_hidden_size(), mc.dtype)
        n = int(getattr(sp, "n", 1) or 1)
        return http_for_config(self.cfg).admit(
            sel, _prompt_len(request), sp.max_tokens, n, self.row_bytes, fetch, calls.CURRENT.get()
        )


_MAKING = threading.Lock()


def frontend_for(input_processor: Any) -> _Frontend:
    """The capture front end of one ``InputProcessor`` (made on first use, once: the
    steering endpoints' calls run on worker threads, beside the requests' own)."""
    fe = getattr(input_processor, "_actbus_frontend", None)
    if fe is None:
        with _MAKING:
            fe = getattr(input_processor, "_actbus_frontend", None)
            if fe is None:
                fe = input_processor._actbus_frontend = _Frontend(input_processor.vllm_config)
    return fe


def _wrap_process_inputs(orig):
    @functools.wraps(orig)
    def process_inputs(self, request_id, prompt, params, *args: Any, **kwargs: Any):
        fe = frontend_for(self)
        try:
            ask = (
                fe.parse(params, trust.trusted(self))
                if fe.active and _is_sampling(params)
                else NOTHING_ASKED
            )
        except ConfigError as e:
            raise _client_error(e) from None
        sel, steer, monitors, scores_back = ask.selection, ask.steer, ask.monitors, ask.scores_back
        http_mode, hooks = ask.http_mode, ask.hooks
        request = orig(self, request_id, prompt, params, *args, **kwargs)
        sp = getattr(request, "sampling_params", None)
        if (sel is None and steer is None and not monitors and not hooks) or sp is None:
            if sp is not None and fe.active:
                _strip(sp)
            return request
        wire: dict[str, Any] = {}
        if steer is not None:
            wire["steer"] = steer.to_wire()
            salt = steer.kv_salt(_prompt_len(request))
            if salt is not None:  # the blocks from its first steered position on
                wire["kv_salt"] = list(salt)
        if hooks:  # a hook may read or change any prompt row: no shared prompt KV
            caller = str(getattr(request, "external_req_id", None) or request_id)
            wire["user_hooks"] = hooks_wire(hooks, caller)
            old = getattr(request, "cache_salt", None)
            request.cache_salt = f"{old}|{hooks_salt()}" if old else hooks_salt()
        returning = scores_back or (sel is not None and sel.returns)
        if monitors or sel is not None:  # rows and scores name the caller's request
            try:
                wire["caller_id"] = check_request_id(
                    str(getattr(request, "external_req_id", None) or request_id),
                    room=ENGINE_ID_ROOM if returning else 0,
                )
            except ConfigError as e:
                raise _client_error(e) from None
            wire["n"] = int(getattr(sp, "n", 1) or 1)
        expects: list[Callable[[str, int], None]] = []
        if monitors:
            wire["monitor"] = list(monitors)
            # Every prompt token is scored, so its stream must be computed, not read
            # from another request's cached KV (which it still fills for others).
            sp.skip_reading_prefix_cache = True
        if scores_back:
            wire["monitor_return"] = True
            try:
                scores = _score_returns(fe)
            except ConfigError as e:
                raise _client_error(e) from None
            streams, widths = _streams(fe, monitors), _widths(fe, monitors)
            plen, budget = _prompt_len(request), sp.max_tokens
            expects.append(
                lambda rid, i: scores.expect(rid, 1, streams, plen, budget, widths, index=i)
            )
        if sel is not None:
            wire.update(sel.to_wire())
        if sel is not None and sel.returns:
            try:
                rows = _returns(fe)
            except ConfigError as e:
                raise _client_error(e) from None
            plen, budget = _prompt_len(request), sp.max_tokens
            # Streamed with rows inline: its SSE chunks take their own tokens' rows.
            chunked = http_mode == "inline" and calls.STREAMED.get()
            expects.append(
                lambda rid, i: rows.expect(rid, 1, sel, plen, budget, index=i, chunked=chunked)
            )
            if http_mode is not None:
                try:
                    ticket = fe.admit_http(sel, request, sp, http_mode == "fetch")
                except ConfigError as e:
                    raise _client_error(e) from None
                # Held by the engine's params: let go with them whatever happens.
                sp._actbus_ticket = ticket
                bounds = http_for_config(fe.cfg)
                expects.append(lambda rid, i: bounds.attach(ticket, rid))
        if expects:  # registered per sample under vLLM's own id, once it has one
            sp._actbus_expect = tuple(expects)
        # The engine owns this copy; the caller's params are never mutated.
        sp.extra_args = {**(sp.extra_args or {}), KEY: wire}
        if sel is None:
            return request
        if sel.bypasses_prefix_cache(_prompt_len(request)):
            sp.skip_reading_prefix_cache = True
        return request

    return process_inputs


def _returns(fe: _Frontend):
    """The collector of returned rows; refuses what it cannot deliver."""
    from vllm.v1.engine.output_processor import RequestState

    from actbus.capture.returns import ReturnCollector

    if not getattr(RequestState, "_actbus_returns", False):
        raise ConfigError(
            "extra_args.actbus.return: this vLLM's output processor is not supported for "
            "returning activations; subscribe to the bus instead"
        )
    return ReturnCollector.for_config(fe.cfg, fe.dp)


def _score_returns(fe: _Frontend):
    """The collector of returned scores; refuses what it cannot deliver."""
    from vllm.v1.engine.output_processor import RequestState

    from actbus.monitor.returns import WHERE, ScoreCollector

    if not getattr(RequestState, "_actbus_returns", False):
        raise ConfigError(
            f"{WHERE}: this vLLM's output processor is not supported for returning "
            "scores; read them with actbus.monitor.reader.ScoreReader instead"
        )
    return ScoreCollector.for_config(fe.cfg, fe.dp)


def _streams(fe: _Frontend, monitors: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """(monitor, layer) of every series a request's monitors publish."""
    defs = fe.cfg.monitor.monitors
    return tuple((name, layer) for name in monitors for layer in defs[name].layers)


def _widths(fe: _Frontend, monitors: tuple[str, ...]) -> dict[str, int]:
    """Scores per row of each monitor: its SAE features, or one."""
    defs = fe.cfg.monitor.monitors
    return {n: len(defs[n].features) if defs[n].kind == "sae" else 1 for n in monitors}


def _wrap_add_request(orig):
    """Each sample of a request whose rows or scores come back is registered with its
    collectors here, where vLLM makes its ``RequestState``: under vLLM's own id of the
    sample (unique, where callers' ids may repeat: ``X-Request-Id``), which the worker
    publishes in ``RowIndex.engine_ids`` and the output wrapper looks up. vLLM adds
    the request to its engine only after this, so no row comes first."""

    @functools.wraps(orig)
    def add_request(self, request, prompt, parent_req=None, request_index=0, *a, **kw):
        new = request.request_id not in getattr(self, "request_states", {})
        out = orig(self, request, prompt, parent_req, request_index, *a, **kw)
        if new:
            # A child's params are a copy without our attribute; its parent's carry it.
            sp = parent_req.sampling_params if parent_req is not None else request.params
            for expect in getattr(sp, "_actbus_expect", ()):
                expect(request.request_id, request_index)
            ticket = getattr(sp, "_actbus_ticket", None)
            state = getattr(self, "request_states", {}).get(request.request_id)
            if ticket is not None and state is not None:
                # The HTTP reservation lives as long as the request's state here: the
                # engine's copy of the params is let go once it is sent to the core.
                state._actbus_ticket = ticket
        return out

    return add_request


def _wrap_abort(orig):
    """A request aborted in the front end (a client gone) leaves no rows or scores
    behind, and its bytes are no longer held for HTTP."""

    @functools.wraps(orig)
    def abort_requests(self, request_ids, *args: Any, **kwargs: Any):
        ids = list(request_ids)
        out = orig(self, ids, *args, **kwargs)
        gone = list(out) if out else ids  # vLLM's own ids of the samples it aborted
        for name in ("actbus.monitor.returns", "actbus.capture.returns"):
            returns = sys.modules.get(name)
            if returns is not None:
                returns.forget(gone)
        bounds = sys.modules.get("actbus.capture.http")
        if bounds is not None and bounds.current() is not None:
            bounds.current().done(gone, aborted=True)
        return out

    return abort_requests


def _wrap_completion_output(orig):
    @functools.wraps(orig)
    def _new_completion_output(self, token_ids, finish_reason, stop_reason, *a, **kw):
        out = orig(self, token_ids, finish_reason, stop_reason, *a, **kw)
        from actbus.capture.returns import collector_for

        collector = collector_for(self.request_id)  # vLLM's own id of this sample
        aborted = str(finish_reason) == "abort"
        if collector is not None:
            from vllm.sampling_params import RequestOutputKind

            out.activations = collector.take(
                self.request_id,
                self.request_index,
                self.detokenizer.num_output_tokens(),
                final=finish_reason is not None,
                delta=self.output_kind == RequestOutputKind.DELTA,
                # Ended here (stop string): the engine hears of it after this.
                ends_follow=not isinstance(stop_reason, str),
                # An abort (a client gone, perhaps while queued) waits for nothing: this
                # runs on the server's event loop, and the engine hears of it after.
                wait=not aborted,
            )
            bounds = sys.modules.get("actbus.capture.http")
            http = bounds.current() if bounds is not None else None
            if http is not None:
                # The sample's id, for its rows to take its reservation's place when kept.
                out.actbus_fetch = http.wants_fetch(self.request_id) and self.request_id
                if finish_reason is not None:
                    http.done([self.request_id], aborted=aborted)
        scores = sys.modules.get("actbus.monitor.returns")
        col = scores.collector_for(self.request_id) if scores is not None else None
        if col is not None:
            from vllm.sampling_params import RequestOutputKind

            out.monitor_scores = col.take(
                self.request_id,
                self.request_index,
                self.detokenizer.num_output_tokens(),
                final=finish_reason is not None,
                delta=self.output_kind == RequestOutputKind.DELTA,
                wait=not aborted,  # aborted: nobody waits for the rest
            )
        return out

    return _new_completion_output


def _wrap_add(orig):
    """Outputs a streaming reader has not taken yet are merged (``aggregate`` for
    DELTA); merge their rows too, or the later pieces' rows would be lost."""

    @functools.wraps(orig)
    def add(self, next_output, aggregate: bool, *args: Any, **kwargs: Any) -> None:
        joined: dict[tuple[str, int], Any] = {}
        if aggregate:
            for attr in ("activations", "monitor_scores"):
                mine = {c.index: getattr(c, attr, None) for c in self.outputs}
                for nc in next_output.outputs:
                    new = getattr(nc, attr, None)
                    if new is not None and nc.index in mine:
                        # Activations, MonitorScores, or a Due (rows a chunk takes)
                        joined[(attr, nc.index)] = type(new).join(mine[nc.index], new)
        orig(self, next_output, aggregate, *args, **kwargs)
        for c in self.outputs:
            for attr in ("activations", "monitor_scores"):
                if (attr, c.index) in joined:
                    setattr(c, attr, joined[(attr, c.index)])

    return add


@functools.cache
def _error_class() -> type[ConfigError]:
    """A ConfigError that vLLM also knows as its own validation error.

    vLLM's servers answer ``VLLMValidationError`` with HTTP 400 and name the
    parameter; offline callers can still catch ValueError/ConfigError.
    """
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ConfigError

    class SelectionError(VLLMValidationError, ConfigError):
        pass

    return SelectionError


def _client_error(e: ConfigError) -> ConfigError:
    msg = str(e)
    return _error_class()(msg, parameter=msg.split(":", 1)[0])


def _is_sampling(params: Any) -> bool:
    return type(params).__name__ == "SamplingParams"


def _strip(sp: Any) -> None:
    """Drop an opt-out marker (``actbus: false``) so the worker sees no selection."""
    if isinstance(sp.extra_args, dict) and KEY in sp.extra_args:
        sp.extra_args = {k: v for k, v in sp.extra_args.items() if k != KEY} or None


def _prompt_len(request: Any) -> int:
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    embeds = getattr(request, "prompt_embeds", None)
    return int(embeds.shape[0]) if embeds is not None else 0
