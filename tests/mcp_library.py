"""An MCP server built with the SDK's server API that uses the whole protocol, not just tools:
resources and a resource template, prompts, completions, instructions, logging, a tools
list_changed notification, and sampling, elicitation and roots asked of its client."""

from __future__ import annotations

import os
import warnings

from mcp.server.elicitation import AcceptedElicitation
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import (
    Completion,
    PromptReference,
    ResourceTemplateReference,
    SamplingMessage,
    TextContent,
    ToolAnnotations,
)
from pydantic import BaseModel

warnings.simplefilter("ignore")  # sampling, roots and logging are deprecated at 2026-07-28
server = MCPServer("library", instructions="Borrow books; the shelf is read-only.")
BOOKS = {"dune": "Frank Herbert", "emma": "Jane Austen"}


@server.resource("library://catalog", mime_type="application/json")
def catalog() -> str:
    return '{"books": ["dune", "emma"]}'


@server.resource("library://books/{slug}")
def book(slug: str) -> str:
    return f"{slug} by {BOOKS.get(slug, 'unknown')}"


@server.prompt()
def review(slug: str, tone: str = "kind") -> str:
    return f"Write a {tone} review of {slug}."


@server.completion()  # type: ignore[no-untyped-call, untyped-decorator]
async def complete(ref: PromptReference | ResourceTemplateReference, argument: object,
                   context: object) -> Completion:
    prefix = str(getattr(argument, "value", ""))
    return Completion(values=[s for s in BOOKS if s.startswith(prefix)])


class Card(BaseModel):
    name: str


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def ask(ctx: Context) -> str:
    """Asks the client for a model's words, the reader's name, and its roots."""
    session = ctx.request_context.session
    sampled = await session.create_message(
        [SamplingMessage(role="user", content=TextContent(type="text", text="a word?"))],
        max_tokens=5, related_request_id=ctx.request_id)
    card = await ctx.elicit("your name?", Card)
    roots = await session.list_roots()
    said = sampled.content.text if isinstance(sampled.content, TextContent) else "?"
    name = card.data.name if isinstance(card, AcceptedElicitation) else card.action
    return f"{said}|{name}|{','.join(str(r.uri) for r in roots.roots)}"


@server.tool()
async def shout(words: str, ctx: Context) -> str:
    """Logs at info level, then says the list of tools changed."""
    await ctx.info(f"shouting {words}")
    await ctx.request_context.session.send_tool_list_changed()
    return words.upper()


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
async def whereami() -> dict[str, object]:
    """The server's working directory and the names in its environment."""
    return {"cwd": os.getcwd(), "env": sorted(os.environ)}


if __name__ == "__main__":
    server.run()
