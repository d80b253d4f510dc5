"""The grammar benchmarks' one schema (`gpu_grammar.py` for kvrail, `vllm_grammar.py` for vLLM):
a realistic nested order, as an API would ask a model to fill (`$defs` and `$ref`s, an array of
objects, enums, bounded integers and numbers, a pattern, optional and nullable fields, no extra
properties), the shape of bench/studies/grammar's `order` grammar."""

from __future__ import annotations

from typing import Any

ORDER_SCHEMA: dict[str, Any] = {
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 80},
                "city": {"type": "string", "maxLength": 40},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["DE", "FR", "GB", "US", "JP"]},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        },
        "Item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": {"type": "string", "maxLength": 60},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                "unit_price": {"type": "number", "minimum": 0, "maximum": 10000},
                "gift": {"type": "boolean"},
            },
            "required": ["sku", "name", "quantity", "unit_price"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 60},
                "email": {"type": "string", "maxLength": 80},
                "address": {"$ref": "#/$defs/Address"},
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"$ref": "#/$defs/Item"},
            "minItems": 1,
            "maxItems": 20,
        },
        "note": {"anyOf": [{"type": "string", "maxLength": 200}, {"type": "null"}]},
    },
    "required": ["order_id", "status", "customer", "items"],
    "additionalProperties": False,
}
