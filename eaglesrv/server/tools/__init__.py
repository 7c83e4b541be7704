"""Tool calling for /v1/chat/completions: the formats models write calls in (formats.py),
rendering conversations with tools through the chat template (prompting.py)."""

from eaglesrv.server.tools.calls import (
    ContentDelta,
    FunctionSpec,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolRequestError,
    forced_functions,
    function_specs,
)
from eaglesrv.server.tools.formats import FORMATS, ToolCallFormat, ToolGrammarError, tool_call_format
from eaglesrv.server.tools.prompting import (
    TemplateInputs,
    default_format,
    render_prompt,
    template_inputs,
    template_renders_tools,
)
from eaglesrv.server.tools.scanning import ToolCallStreamParser

__all__ = ["FORMATS", "ContentDelta", "FunctionSpec", "StreamEvent", "TemplateInputs", "ToolCall", "ToolCallDelta",
           "ToolCallFormat", "ToolCallStreamParser", "ToolGrammarError", "ToolRequestError", "default_format",
           "forced_functions", "function_specs", "render_prompt", "template_inputs", "template_renders_tools",
           "tool_call_format"]
