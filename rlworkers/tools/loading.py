"""Loading tools: plain functions from tool specs, and verl ``BaseTool`` classes from verl's tool config YAML.

``load_tools(specs)`` takes specs of the forms reward specs have (rlworkers.rewards.loading), each naming one plain
typed function, which becomes a FunctionTool:

- "path/to/file.py:function_name": the file is executed as a fresh module (rlworkers.loading.load_file_module);
- "package.module:function_name": the module is imported.

``tools_from_config(path)`` reads verl's tool config (``examples/sglang_multiturn/config/tool_config/*.yaml``) as
verl's ``initialize_tools_from_config`` (``verl/tools/utils/tool_registry.py``) does::

    tools:
      - class_name: "my_package.my_tools.Gsm8kTool"     # or "path/to/my_tools.py:Gsm8kTool"
        config: {type: native}                          # passed to the constructor as `config`
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

and builds each as ``cls(config=config, tool_schema=OpenAIFunctionToolSchema)``, the schema left None when the
entry has none (the class then gives it by ``get_openai_tool_schema``). Differences from verl: the file is read with
``yaml.safe_load`` (no OmegaConf ``${...}`` interpolation); ``class_name`` may also name a file; the class must
subclass rlworkers' BaseTool (a class still importing verl's is refused with the import to change); ``type: mcp``
is refused (MCP servers are not supported).

User code is loaded only from what a spec or ``class_name`` names. Each tool remembers where it came from, so that
``tools_by_name`` can name both sources of a duplicate name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import ValidationError

from rlworkers.loading import UserCodeNotFoundError, import_module_named, load_file_module
from rlworkers.tools.base_tool import BaseTool
from rlworkers.tools.function_tool import FunctionTool
from rlworkers.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)

SPEC_FORMS = "'path/to/file.py:function_name', 'package.module:function_name'"
CONFIG_FORM = (
    "tools: [{class_name: 'package.module.ClassName' or 'path/to/file.py:ClassName', config: {type: native}, "
    "tool_schema: {type: function, function: {name, description, parameters}}}]"
)


def load_tools(specs: str | list[str]) -> list[BaseTool]:
    """One FunctionTool per spec (see the module docstring).

    Raises:
        ValueError: a spec has neither form, names a missing file, module or attribute, names something that is not
            a function (a BaseTool class: the message points to the tool config YAML), or the function cannot be
            described as a tool; or two specs give tools of the same name.
    """
    tools = []
    for spec in [specs] if isinstance(specs, str) else specs:
        fn = _function_of_spec(spec)
        try:
            tool = FunctionTool(fn)
        except ValueError as e:
            raise ValueError(f"bad tool spec {spec!r}: {e}") from e
        tool._rlflow_source = f"tool spec {spec!r}"
        tools.append(tool)
    tools_by_name(tools)
    return tools


def _function_of_spec(spec: Any) -> Callable:
    def bad_spec(why: str) -> ValueError:
        return ValueError(f"bad tool spec {spec!r}: {why}. Accepted forms: {SPEC_FORMS}")

    if not isinstance(spec, str) or not spec.strip():
        raise bad_spec("expected a non-empty string")
    if ":" not in spec:
        raise bad_spec("no ':function_name' part")
    target, function_name = spec.rsplit(":", 1)  # rsplit: a Windows path has a colon of its own
    if not function_name.isidentifier():
        raise bad_spec(f"{function_name!r} is not a function name")
    try:
        module = _load_module(target, spec)
    except UserCodeNotFoundError as e:
        raise bad_spec(str(e)) from e
    fn = getattr(module, function_name, None)
    if fn is None:
        raise bad_spec(f"{target!r} has no attribute {function_name!r}")
    if isinstance(fn, type) and issubclass(fn, BaseTool):
        raise bad_spec(
            f"{function_name} is a BaseTool class, not a function: list it in a tool config YAML "
            f"({CONFIG_FORM}) and pass that file instead"
        )
    if not callable(fn) or isinstance(fn, type):
        raise bad_spec(f"{target}:{function_name} is a {type(fn).__name__}, not a function")
    return fn


def _load_module(target: str, spec: str) -> ModuleType:
    try:
        return load_file_module(target, "tool", spec) if target.endswith(".py") else import_module_named(target)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "verl":
            raise
        raise UserCodeNotFoundError(
            f"{target!r} imports {e.name!r}, and verl is not installed. Fix: port the tool by changing "
            "`from verl.tools.base_tool import BaseTool` to `from rlworkers.tools.base_tool import BaseTool` and "
            "`from verl.tools.schemas import ...` to `from rlworkers.tools.schemas import ...`"
        ) from e


def tools_from_config(path: str) -> list[BaseTool]:
    """The tools of a verl tool config YAML file (see the module docstring), in the file's order.

    Raises:
        ValueError: the file is missing or not YAML, has no ``tools`` list, an entry lacks ``class_name`` or
            ``config.type``, has ``type: mcp`` or another type, names a missing class, one whose file still imports
            verl, or one that does not subclass rlworkers' BaseTool, or has a ``tool_schema`` that does not validate
            (each message names the file, the entry index and the fix); or two entries give tools of the same name.
        Exception: whatever the tool's constructor raises, with a note naming the file and the entry.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"tool config {str(file)!r} does not exist. Expected a YAML file of the form {CONFIG_FORM}")
    try:
        document = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"tool config {str(file)!r} is not valid YAML ({e}). Expected {CONFIG_FORM}") from e
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"tool config {str(file)!r} has no `tools:` list. Expected {CONFIG_FORM}")
    tools = [_tool_of_entry(file, index, entry) for index, entry in enumerate(entries)]
    tools_by_name(tools)
    return tools


def _tool_of_entry(file: Path, index: int, entry: Any) -> BaseTool:
    where = f"tool config {str(file)!r}, tools[{index}]"

    def bad_entry(why: str) -> ValueError:
        return ValueError(f"{where}: {why}. Each entry reads {CONFIG_FORM}")

    if not isinstance(entry, dict):
        raise bad_entry(f"expected a mapping, got {type(entry).__name__}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        raise bad_entry("no `class_name`")
    config = entry.get("config")
    tool_type = config.get("type") if isinstance(config, dict) else None
    if tool_type == "mcp":
        raise bad_entry("`type: mcp` (tools from MCP servers) is not supported; only `type: native` is")
    if tool_type != "native":
        raise bad_entry(f"`config.type` must be `native`, got {tool_type!r}")
    tool_cls = _class_of_entry(class_name, bad_entry)
    tool_schema = None
    if entry.get("tool_schema") is not None:
        try:
            tool_schema = OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
        except ValidationError as e:
            raise bad_entry(f"its `tool_schema` does not validate as an OpenAIFunctionToolSchema: {e}") from e
    try:
        tool = tool_cls(config=config, tool_schema=tool_schema)
    except Exception as e:
        e.add_note(f"while building {class_name} from {where}")
        raise
    tool._rlflow_source = f"{where} ({class_name})"
    return tool


def _class_of_entry(class_name: str, bad_entry: Callable[[str], ValueError]) -> type[BaseTool]:
    if ":" in class_name:
        target, attribute = class_name.rsplit(":", 1)
    else:
        target, _, attribute = class_name.rpartition(".")
    if not target or not attribute.isidentifier():
        raise bad_entry(
            f"`class_name` {class_name!r} is neither 'package.module.ClassName' nor 'path/to/file.py:ClassName'"
        )
    try:
        module = _load_module(target, class_name)
    except UserCodeNotFoundError as e:
        hint = " (verl's own tools are not installed: copy the tool's file, change its verl imports)"
        raise bad_entry(f"`class_name` {class_name!r}: {e}{hint if class_name.startswith('verl.') else ''}") from e
    tool_cls = getattr(module, attribute, None)
    if tool_cls is None:
        raise bad_entry(f"`class_name` {class_name!r}: {target!r} has no attribute {attribute!r}")
    if not (isinstance(tool_cls, type) and issubclass(tool_cls, BaseTool)):
        raise bad_entry(
            f"`class_name` {class_name!r} is not a subclass of rlworkers' BaseTool. Fix: in its file, import "
            "`from rlworkers.tools.base_tool import BaseTool` (not verl's) and "
            "`from rlworkers.tools.schemas import ...`"
        )
    return tool_cls


def tools_by_name(tools: list[BaseTool]) -> dict[str, BaseTool]:
    """The tools keyed by name (what the model writes in a call).

    Raises:
        ValueError: two tools have the same name (the message names where each came from).
    """
    by_name: dict[str, BaseTool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ValueError(
                f"two tools are named {tool.name!r}: {_source(by_name[tool.name])} and {_source(tool)}. "
                "Fix: rename one (the function, or `tool_schema.function.name` in the tool config)"
            )
        by_name[tool.name] = tool
    return by_name


def _source(tool: BaseTool) -> str:
    return getattr(tool, "_rlflow_source", f"{type(tool).__qualname__} instance")
