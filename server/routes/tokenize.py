"""POST /tokenize and /detokenize (vLLM's extras): the server's own tokenizer and chat template, for clients that
budget prompts against the context length."""

from fastapi import APIRouter, Request

from server.errors import bad_request
from server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from server.responses import DetokenizeResponse, TokenizeResponse
from server.routes.chat import render_prompt
from server.routes.common import ERROR_RESPONSES, check_model, serving

router = APIRouter(responses=ERROR_RESPONSES)


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx = serving(request)
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        prompt = body.prompt or ""
        tokens = await ctx.tokenize(
            len(prompt), ctx.tokenizer.encode, prompt, add_special_tokens=body.add_special_tokens
        )
    else:
        chat = ChatCompletionRequest(
            model=ctx.settings.model_name,
            messages=body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
        )
        tokens = await render_prompt(ctx, chat, chat.tool_dicts() or None)
    return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = serving(request)
    check_model(ctx, body.model)
    vocab = ctx.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"tokens: {bad[0]} is not a token id (vocabulary size {vocab})", param="tokens")
    return DetokenizeResponse(prompt=await ctx.tokenize(len(body.tokens) * 4, ctx.tokenizer.decode, body.tokens))
