"""The tool side of multi-turn agent rollouts: verl's tool interface, plain functions as tools, loading them,
reading tool calls from the model's text, and running them with time limits.

- schemas.py, base_tool.py: verl's ``verl/tools/schemas.py`` models and ``BaseTool``, for tools ported by changing
  their imports;
- function_tool.py: ``FunctionTool``, a plain typed function (schema from its signature and docstring);
- loading.py: ``load_tools`` (function specs), ``tools_from_config`` (verl's tool config YAML), ``tools_by_name``;
- parsing.py: ``parse_tool_calls`` (Hermes ``<tool_call>`` format), ``tools_system_prompt``,
  ``template_supports_tools``;
- execution.py: ``run_calls`` and ``ToolSession`` (where tools run, time limits, error outcomes).

No Ray, Prefect or MLflow here: the rollout worker that runs the agent loop imports this package.
"""

from rlworkers.tools.base_tool import BaseTool
from rlworkers.tools.execution import ERROR_KINDS, ToolOutcome, ToolSession, run_calls
from rlworkers.tools.function_tool import FunctionTool, NotTextResultError, function_tool_schema
from rlworkers.tools.loading import load_tools, tools_by_name, tools_from_config
from rlworkers.tools.parsing import (
    ParsedTurn,
    ToolCall,
    parse_tool_calls,
    template_supports_tools,
    tools_system_prompt,
)
from rlworkers.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = [
    "ERROR_KINDS",
    "BaseTool",
    "FunctionTool",
    "NotTextResultError",
    "OpenAIFunctionToolSchema",
    "ParsedTurn",
    "ToolCall",
    "ToolOutcome",
    "ToolResponse",
    "ToolSession",
    "function_tool_schema",
    "load_tools",
    "parse_tool_calls",
    "run_calls",
    "template_supports_tools",
    "tools_by_name",
    "tools_from_config",
    "tools_system_prompt",
]
