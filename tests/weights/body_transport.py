"""A transport added the way a built-in one is: this one file plus its line in ``TRANSPORTS`` (the test adds
the line). Full weights as one safetensors HTTP body; ``record`` names a file each sent version is appended to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.weights.engines import raise_errors
from agentrl.weights.transport import Sent, Transport, TransportOptions


class BodyOptions(TransportOptions):
    record: Path | None = Field(None, description="a file each sent weight version is appended to")


class BodyTransport(Transport):
    name = "body"
    carries = frozenset({"full"})
    Options = BodyOptions

    def send_full(self, tensors: list[tuple[str, Any]], weight_version: str, urls: Sequence[str]) -> Sent:
        from agentrl.engine.weight_loading import update_weights_from_tensor_body

        body = update_weights_from_tensor_body(tensors, weight_version=weight_version, fmt="safetensors")
        raise_errors(self.engines.call_all("/update_weights_from_tensor", body, urls=urls))
        if self.options.record is not None:
            with self.options.record.open("a") as out:
                out.write(weight_version + "\n")
        return Sent(len(body["serialized_named_tensors"][0]), list(urls))
