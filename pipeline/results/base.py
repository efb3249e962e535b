"""The base of every typed result: strict (unknown keys refused) with a JSON form."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Result(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
