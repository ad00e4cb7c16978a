"""``actbus/<model>`` for Inspect AI: an ``actbus serve`` (or ``vllm serve`` with the
plugin) reached over its OpenAI API, whose returned activations and monitor scores land
in ``ModelOutput.metadata["actbus"]``.

Per call, ``GenerateConfig.extra_body={"actbus": {...}}`` carries the request's actbus
entry (capture with ``"return"``, steering, monitors with ``"monitor_return"``): it is
sent as ``vllm_xargs``, the form vLLM's server passes on. The metadata holds the
choice's ``actbus`` field as the server wrote it (JSON, so it lands in the eval log);
``actbus.client.from_metadata`` turns it into tensors. Requests are not streamed: a
whole response carries every row at once.

The server: ``-M base_url=...`` / ``--model-base-url``, or ``ACTBUS_BASE_URL``
(default ``http://127.0.0.1:8000/v1``); its API key: ``ACTBUS_API_KEY`` (none needed
for a server without ``--api-key``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from inspect_ai.model import GenerateConfig, ModelOutput
from inspect_ai.model._providers.openai_compatible import OpenAICompatibleAPI

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"


class ActbusAPI(OpenAICompatibleAPI):
    """vLLM's OpenAI chat API, with actbus's entry per call and its fields kept."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),  # noqa: B008 (Inspect's own default)
        **model_args: Any,
    ) -> None:
        model_args.pop("stream", None)  # every row comes in the one response
        super().__init__(
            model_name=model_name,
            base_url=base_url or os.environ.get("ACTBUS_BASE_URL") or DEFAULT_BASE_URL,
            api_key=api_key or os.environ.get("ACTBUS_API_KEY") or "none",
            config=config,
            service="actbus",
            stream=False,
            **model_args,
        )

    def service_model_name(self) -> str:
        """The served model's name as given: Inspect took ``actbus/`` off already (its
        own removes the first ``actbus/`` anywhere, in a path too)."""
        return self.model_name

    def completion_params(self, config: GenerateConfig, tools: bool) -> dict[str, Any]:
        params = super().completion_params(config, tools)
        extra = dict(params.get("extra_body") or {})
        entry = extra.pop("actbus", None)
        if entry is not None:
            text = entry if isinstance(entry, str) else json.dumps(entry)
            extra["vllm_xargs"] = {**(extra.get("vllm_xargs") or {}), "actbus": text}
            params["extra_body"] = extra
        return params

    async def generate(self, input, tools, tool_choice, config):  # type: ignore[override]
        result = await super().generate(input, tools, tool_choice, config)
        output, call = result if isinstance(result, tuple) else (result, None)
        response = getattr(call, "response", None)
        if isinstance(output, ModelOutput) and isinstance(response, dict):
            for choice in response.get("choices") or ():
                field = choice.pop("actbus", None)  # the log keeps it once: in metadata
                if field is not None and choice.get("index", 0) == 0:
                    output.metadata = {**(output.metadata or {}), "actbus": field}
        return result
