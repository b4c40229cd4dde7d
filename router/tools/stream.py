"""Tool calls in a chat stream, as OpenAI sends them: each call's first delta carries `index`,
`id`, `type` and `function.name`, the arguments follow in it or in later deltas of that index;
the last chunk's finish_reason is "tool_calls".

A named function's arguments stream as they are generated. Under `auto` the content streams up
to where a call may begin (the parser's `hold_from`; trailing whitespace waits too, as the whole
answer's content drops it before a call); the rest waits for the end, when the whole text is
parsed exactly as a non-streamed answer is, so both agree. `required` waits for the end too.
"""

from __future__ import annotations

from router.generation import ChoiceState, Job
from router.protocol import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from router.responses import chat_logprobs
from router.tokenizer import Prompts
from router.tools.answer import finish_reason, tool_calls
from router.tools.choice import ToolPlan
from router.tools.protocol import DeltaFunctionCall, DeltaToolCall
from workers.api import RequestOutput


class ToolStream:
    """One choice's stream: takes its text piece by piece, gives content and call deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # chars of `text` sent as content
        self.called = False

    def feed(self, piece: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += piece
        if self.plan.choice == "named":
            return "", self._named(piece)
        if finished:
            return self._finish()
        upto = len(self.text[: self.plan.hold_from(self.text)].rstrip())
        if upto <= self.sent:
            return "", []
        content, self.sent = self.text[self.sent:upto], upto
        return content, []

    def _named(self, piece: str) -> list[DeltaToolCall]:
        if self.called:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))] \
                if piece else []
        self.called = True
        return [DeltaToolCall(index=0, id=self.plan.parser.call_id(), type="function",
                              function=DeltaFunctionCall(name=self.plan.name, arguments=piece))]

    def _finish(self) -> tuple[str, list[DeltaToolCall]]:
        parsed = self.plan.answer(self.text)
        if not parsed.calls:
            return self.text[self.sent:], []
        self.called = True
        deltas = [DeltaToolCall(index=i, id=call.id, type="function",
                                function=DeltaFunctionCall(name=call.function.name,
                                                           arguments=call.function.arguments))
                  for i, call in enumerate(tool_calls(self.plan, parsed.calls))]
        return (parsed.content or "")[self.sent:], deltas


def tool_chunk(job: Job, choice: ChoiceState, out: RequestOutput, stream: ToolStream,
               prompts: Prompts) -> ChatCompletionChunk | None:
    """The chunk for one engine output of a choice under a tool plan; None when it carries
    nothing (its text held back)."""
    content, deltas = stream.feed(out.text, out.finished)
    lp = (chat_logprobs(out.logprobs or [], prompts, job.logprobs)
          if job.logprobs is not None and out.logprobs else None)
    if not content and not deltas and lp is None and not out.finished:
        return None
    finish = finish_reason(choice.finish_reason, stream.called) if out.finished else None
    delta = DeltaMessage(content=content or None, tool_calls=deltas or None)
    item = ChatStreamChoice(index=choice.index, delta=delta, logprobs=lp, finish_reason=finish,
                            stop_reason=choice.stop_reason if out.finished else None)
    usage = job.usage([choice]) if job.continuous_usage else None
    return ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[item],
                               usage=usage)
