"""The KV transfer's settings and its fault injection: a part of `kvrail.settings.Settings`
(which inherits them), apart so that file stays short. Read nothing here: `load_settings` does."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field


class TransferSettings(BaseModel):
    """How a prefill worker writes KV to a decode worker, and the faults tests inject there."""

    kv_transfer_layer_groups: Annotated[int, Field(ge=0, le=1024)] | Literal["auto"] = Field(
        0,
        description="write a prompt's KV in this many groups of consecutive layers, each as soon "
        "as the prefill computed it (overlapping the next layers; docs/layerwise.md); 0: one "
        "write of every layer after the prefill (the default until measured); auto: a count per "
        "prompt from the link's measured bandwidth and the prefill's measured speed",
    )  # fmt: skip
    fault_corrupt_kv_transfers: float = Field(
        0.0, ge=0, le=1,
        description="fault injection for tests: the fraction of KV transfers a decode worker "
        "receives whose first block gets one byte flipped before validation",
    )  # fmt: skip
    fault_fail_kv_writes: float = Field(
        0.0, ge=0, le=1,
        description="fault injection for tests: the fraction of KV writes a prefill worker "
        "attempts that fail (a transfer error) before anything is written",
    )  # fmt: skip
    fault_delay_kv_writes_s: float = Field(
        0.0, ge=0, le=60,
        description="fault injection for tests: a delay before every KV write (before every "
        "layer group's write, layer-wise)",
    )  # fmt: skip
    fault_lose_kv_notifications: float = Field(
        0.0, ge=0, le=1,
        description="fault injection for tests: the fraction of KV writes whose completion "
        "notification is lost (the bytes land, the decode worker never hears of it)",
    )  # fmt: skip
