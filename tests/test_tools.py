"""Tools for agent environments: schemas, the fallback prompt, parsing calls, guarded runs."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from lora_async.envs.base import ToolCall
from lora_async.envs.tools import (
    ToolBox, ToolError, fallback_tool_prompt, parse_tool_calls, strip_tool_calls, template_supports_tools,
    tool_schemas,
)
from tests.tool_fixtures import ameet, anap, calculate, crash, meet, nap, undocumented

FORMAT = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def local_tool() -> None:
    def inner(x: int) -> int:
        """Doc.

        Args:
            x: a number
        """
        return x

    return inner


def test_schema_from_a_typed_documented_function():
    (schema,) = tool_schemas([calculate])
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "calculate" and fn["description"] == "Evaluate an arithmetic expression."
    assert fn["parameters"]["properties"] == {
        "expression": {"type": "string", "description": 'digits and + - * / ( ), e.g. "12 * (3 + 4)"'}
    }
    assert fn["parameters"]["required"] == ["expression"]
    prompt = fallback_tool_prompt([schema])
    assert "- calculate: Evaluate an arithmetic expression. Parameters: {" in prompt
    assert '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>' in prompt


def test_unusable_tools_are_refused_by_name():
    with pytest.raises(ToolError, match="undocumented.*no docstring"):
        tool_schemas([undocumented])
    with pytest.raises(ToolError, match="<lambda>: tools must be module-level functions"):
        tool_schemas([lambda x: x])
    with pytest.raises(ToolError, match="inner: tools must be module-level functions.*inside a function"):
        tool_schemas([local_tool()])


def test_parse_good_calls_and_strip_them():
    text = ('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": "2+2"}}</tool_call>'
            ' and <tool_call>\n{"name": "nap", "parameters": {"seconds": 0}}\n</tool_call> done')
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculate", {"expression": "2+2"}), ToolCall("nap", {"seconds": 0})]
    assert errors == []
    assert strip_tool_calls(text) == "Let me compute.  and  done"


def test_parse_unterminated_final_block_and_string_arguments():
    as_string = '{"name": "calculate", "arguments": "{\\"expression\\": \\"1\\"}"}'
    calls, errors = parse_tool_calls(f"ok <tool_call>{as_string}")  # cut by the token limit
    assert calls == [ToolCall("calculate", {"expression": "1"})] and errors == []
    assert strip_tool_calls('ok <tool_call>{"name": "calculate"') == "ok"


def test_parse_malformed_blocks_give_readable_errors_in_order():
    text = ('<tool_call>{"name": "calculate" "arguments": {}}</tool_call>'
            '<tool_call>{"arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "calculate", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calculate", "arguments": {"expression": "3"}}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert calls == [ToolCall("calculate", {"expression": "3"})]
    assert errors == [
        f"error: could not parse tool call: Expecting ',' delimiter at char 21; write {FORMAT}",
        f'error: the tool call has no "name"; write {FORMAT}',
        f"error: the \"arguments\" of tool call 'calculate' must be a JSON object; write {FORMAT}",
    ]


@pytest.fixture
def toolbox():
    box = ToolBox([calculate, nap], timeout_s=1.0)
    yield box
    box.close()


def run(box: ToolBox, name: str, **arguments) -> object:
    return asyncio.run(box.run(ToolCall(name, arguments)))


def test_toolbox_runs_a_call_and_reports_mistakes(toolbox):
    good = run(toolbox, "calculate", expression="6 * 7")
    assert good.content == "42" and not good.error
    assert good.call == ToolCall("calculate", {"expression": "6 * 7"})
    unknown = run(toolbox, "calc", expression="1")
    assert unknown.error and unknown.content == "error: unknown tool 'calc'; available: calculate, nap"
    extra = run(toolbox, "calculate", expression="1", precision=2)
    assert extra.error
    assert extra.content == "error: TypeError: calculate() got an unexpected keyword argument 'precision'"
    missing = run(toolbox, "calculate")
    assert missing.content == "error: TypeError: calculate() missing a required argument: 'expression'"
    raised = run(toolbox, "calculate", expression="import os")
    assert raised.error and raised.content.startswith("error: ValueError: only digits")
    assert toolbox.calls == 5 and toolbox.errors == 4 and toolbox.timeouts == 0
    # The model reads the message; the person reading last_error also gets where it was raised.
    assert toolbox.last_error.startswith("calculate: ValueError: only digits")
    assert "tool_fixtures.py:" in toolbox.last_error


def test_toolbox_cuts_off_a_hanging_tool_and_recovers(toolbox):
    hung = run(toolbox, "nap", seconds=30)
    assert hung.error and hung.content == "error: tool 'nap' timed out after 1s"  # cut off by its timeout
    assert toolbox.timeouts == 1 and toolbox.errors == 1
    assert run(toolbox, "nap", seconds=0).content == "slept 0"  # a fresh worker took over


def test_a_tool_that_kills_its_worker_is_an_error_and_the_next_call_works():
    box = ToolBox([crash, calculate], timeout_s=5.0, workers=1)
    try:
        died = run(box, "crash", code=3)
        assert died.error and died.content.startswith("error: worker died (exit code 3)")
        assert run(box, "crash", code=4).content.startswith("error: worker died (exit code 4)")  # restarted
        assert run(box, "calculate", expression="1+1").content == "2"
        assert box.errors == 2 and box.timeouts == 0
    finally:
        box.close()


def meetings(box: ToolBox, name: str, directory: Path, parties: int) -> list[dict]:
    """`parties` calls of a meeting tool at once, from one event loop; their parsed reports."""
    call = ToolCall(name, {"directory": str(directory), "parties": parties, "patience": 20.0})

    async def together():
        return await asyncio.gather(*(box.run(call) for _ in range(parties)))

    results = asyncio.run(together())
    assert not any(r.error for r in results), [r.content for r in results]
    return [json.loads(r.content) for r in results]


def test_plain_tool_calls_run_at_once_in_separate_processes(tmp_path):
    box = ToolBox([meet], timeout_s=30.0, workers=4)
    try:
        reports = meetings(box, "meet", tmp_path, parties=4)
    finally:
        box.close()
    # Each call waits until all four have arrived: one after another, none would have met.
    assert all(r["met"] for r in reports)
    assert max(r["started"] for r in reports) < min(r["ended"] for r in reports)
    assert len({r["pid"] for r in reports}) == 4  # a plain call holds its process


def test_async_tool_calls_run_at_once_in_one_process(tmp_path):
    box = ToolBox([ameet], timeout_s=30.0, workers=4)
    try:
        reports = meetings(box, "ameet", tmp_path, parties=4)
    finally:
        box.close()
    assert all(r["met"] for r in reports)
    assert max(r["started"] for r in reports) < min(r["ended"] for r in reports)
    assert len({r["pid"] for r in reports}) == 1 and reports[0]["pid"] != os.getpid()


def test_a_hanging_call_does_not_hold_back_a_later_one():
    box = ToolBox([nap], timeout_s=5.0, workers=2)

    async def hang_then_quick():
        # both workers started first (two calls at once): the quick call then waits for no process
        # to start, only for one beside the hanging call's (or, wrongly, behind it)
        await asyncio.gather(*(box.run(ToolCall("nap", {"seconds": 0.5})) for _ in range(2)))
        hung = asyncio.create_task(box.run(ToolCall("nap", {"seconds": 600})))
        await asyncio.sleep(0)  # the hanging call is submitted first
        quick = asyncio.create_task(box.run(ToolCall("nap", {"seconds": 0})))
        done, _ = await asyncio.wait({hung, quick}, return_when=asyncio.FIRST_COMPLETED)
        return done, quick, await hung

    try:
        done, quick, hung = asyncio.run(hang_then_quick())
    finally:
        box.close()
    assert done == {quick} and quick.result().content == "slept 0"  # back while the other still hung
    assert hung.error and hung.content == "error: tool 'nap' timed out after 5s"
    assert box.calls == 4 and box.errors == 1 and box.timeouts == 1


def test_a_hanging_async_call_is_cancelled_and_the_others_in_its_process_finish(tmp_path):
    box = ToolBox([anap], timeout_s=5.0, workers=4)
    marker = tmp_path / "cancelled"

    async def hang_among_quick():
        hung = asyncio.create_task(box.run(ToolCall("anap", {"seconds": 600, "marker": str(marker)})))
        quick = [asyncio.create_task(box.run(ToolCall("anap", {"seconds": 0.1, "marker": str(marker)})))
                 for _ in range(3)]
        finished = await asyncio.gather(*quick)
        still_hung = not hung.done()
        cut = await hung
        # The next call waits for the worker to confirm the cancellation (the marker is written by then).
        after = await box.run(ToolCall("anap", {"seconds": 0, "marker": str(marker)}))
        return finished, still_hung, cut, after

    try:
        finished, still_hung, hung, after = asyncio.run(hang_among_quick())
    finally:
        box.close()
    assert still_hung and [r.error for r in finished] == [False] * 3
    assert hung.error and hung.content == "error: tool 'anap' timed out after 5s"
    # One process throughout: the hanging coroutine was cancelled in it (it wrote the marker),
    # not killed with its process, and the call after the cut-off ran there too.
    pids = {r.content for r in finished} | {after.content}
    assert len(pids) == 1 and marker.read_text() in pids
    assert box.timeouts == 1 and box.errors == 1


def test_tool_module_outside_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "far_tools.py").write_text(
        'def echo(text: str) -> str:\n    """Echo.\n\n    Args:\n        text: what to echo\n    """\n'
        "    return text\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import far_tools

    box = ToolBox([far_tools.echo], timeout_s=5.0)
    try:
        assert run(box, "echo", text="hi").content == "hi"
    finally:
        box.close()
        sys.modules.pop("far_tools", None)


def test_a_tool_whose_module_broke_after_startup_is_unavailable(tmp_path, monkeypatch):
    module = tmp_path / "breaking_tools.py"
    module.write_text(
        'import os\n\n\ndef die(code: int) -> str:\n    """Die.\n\n    Args:\n        code: exit code\n    """\n'
        "    os._exit(code)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import breaking_tools

    box = ToolBox([breaking_tools.die], timeout_s=5.0, workers=1)
    try:
        module.write_text('raise ImportError("the file was broken meanwhile")\n')
        assert run(box, "die", code=3).content.startswith("error: worker died (exit code 3)")
        gone = run(box, "die", code=3)  # a new worker cannot import the module any more
        assert gone.error and gone.content == "error: tool 'die' is unavailable"
        assert "the file was broken meanwhile" in box.last_error
    finally:
        box.close()
        sys.modules.pop("breaking_tools", None)


def test_template_supports_tools(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    schemas = tool_schemas([calculate])
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert not template_supports_tools(tok, schemas)  # SmolLM2's template ignores tools=
    tok.chat_template = (
        "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    assert template_supports_tools(tok, schemas)


def test_simulated_latency_draws_a_seeded_lognormal():
    from lora_async.envs.tools import SimulatedLatency

    stream = SimulatedLatency(1.0, 1.0, seed=3)
    draws = [stream.draw() for _ in range(2001)]
    assert SimulatedLatency(1.0, 1.0, seed=3).draw() == draws[0]  # the same seed, the same stream
    ordered = sorted(draws)
    assert 0.9 < ordered[1000] < 1.1  # the median is the median asked for
    assert ordered[-20] > 8.0  # and the tail is long (p99 of sigma 1 is about 10x the median)
    assert SimulatedLatency(2.0, 0.0).draw() == 2.0 and SimulatedLatency(0.0, 1.0).draw() == 0.0


def test_every_tool_call_waits_its_simulated_delay_first(monkeypatch):
    from lora_async.envs import tools
    from lora_async.envs.tools import SimulatedLatency

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds: float) -> None:
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(tools.asyncio, "sleep", recording_sleep)
    box = ToolBox([calculate], timeout_s=5.0, latency=SimulatedLatency(0.5, 0.0))
    try:
        results = [run(box, "calculate", expression="6 * 7") for _ in range(3)]
        unknown = run(box, "nope")
    finally:
        box.close()
    assert [r.content for r in results] == ["42"] * 3 and unknown.error
    assert slept == [0.5, 0.5, 0.5]  # an unknown tool reaches no remote, so it waits nothing
