"""OpenAI's Responses API (`POST /v1/responses`), stateless, served by the chat path.

A request (`request.ResponsesRequest`) is translated to the chat completion that serves it
(`translate.Translation`), which the router serves as any other (its template, tokenizing,
admission, sampling); the pieces of its answer are rendered as a Response or its events
(`events.ResponseRender`, shapes in `body`). Nothing is stored: a response can be neither
retrieved nor continued by id, so a client sends the whole conversation each time (as the
Agents SDK and LangChain do by default).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Header
from fastapi.routing import APIRoute

from kvrail.router.api.errors import ApiError
from kvrail.router.api.responses_api.body import ResponseObject, restated
from kvrail.router.api.responses_api.render import ResponseRender
from kvrail.router.api.responses_api.request import ResponsesRequest
from kvrail.router.api.responses_api.translate import Translation
from kvrail.router.api.sampling import Defaults
from kvrail.router.api.schemas import ChatCompletionRequest

__all__ = [
    "PATH", "ResponseObject", "ResponseRender", "ResponsesRequest", "documented_route", "respond",
]  # fmt: skip

PATH = "/v1/responses"
T = TypeVar("T")


async def respond(
    req: ResponsesRequest,
    defaults: Defaults,
    serve_chat: Callable[[ChatCompletionRequest, ResponseRender], Awaitable[T]],
) -> T:
    """Serve `req` as the chat completion it translates to: `serve_chat` serves that one,
    rendered by the `ResponseRender` it is given. `defaults` are the router's sampling
    defaults (a Response restates the temperature and top_p that applied). Raises ApiError
    naming the Responses field at fault."""
    translation = Translation.of(req)
    chat = translation.chat_request()
    render = ResponseRender(restated(req, defaults), translation.renamed)
    try:
        return await serve_chat(chat, render)
    except ApiError as err:
        raise translation.renamed(err) from None


def documented_route(errors: dict[int | str, dict[str, Any]]) -> APIRoute:
    """The endpoint as FastAPI would declare it, for the OpenAPI document only (the router
    serves it as plain ASGI; the function is never called). `errors`: the error responses."""

    async def create_response(
        body: ResponsesRequest, authorization: str | None = Header(None)
    ) -> None:
        """Create a response (OpenAI's Responses API; stateless: nothing is stored)."""

    return APIRoute(
        PATH, create_response, methods=["POST"], response_model=ResponseObject, responses=errors
    )
