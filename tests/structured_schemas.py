"""Test helper: the nested JSON schema the structured-output tests constrain generation to.

Small bounds keep every answer short (about 30 tokens at most), so the tests stay quick.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    zip: str = Field(pattern=r"^[0-9]{3}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    address: Address
    tags: list[bool] = Field(max_length=2)
