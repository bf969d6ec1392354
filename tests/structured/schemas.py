"""Schemas the structured-output tests constrain to: nested objects, enums, arrays and
optional fields, bounded (lengths, ranges, items) so that a random-weight model finishes
its JSON well inside the token budget."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    city: str = Field(max_length=6)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    favorite: Color
    tags: list[Annotated[str, StringConstraints(max_length=5)]] = Field(max_length=3)
    address: Address
    nickname: str | None = Field(default=None, max_length=5)
