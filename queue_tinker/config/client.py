"""The Python client's settings: QT_TENANT."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ClientConfig(BaseModel):
    """The Python client: who it acts for."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Tenant the Python client acts for. It talks to Redis directly, so it is "
        "trusted to say who it is; the gateway instead learns the tenant from the API key.",
    )
