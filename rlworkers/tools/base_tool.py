"""``BaseTool``: the interface of a tool, with verl's method names, signatures and defaults (verl/tools/base_tool.py).

A verl tool ports by changing ``from verl.tools.base_tool import BaseTool`` to ``from rlworkers.tools.base_tool
import BaseTool``. The life of a tool in one trajectory (rlworkers.tools.execution.ToolSession):

- ``create(create_kwargs=row["tools_kwargs"][name]["create_kwargs"])`` once, when the trajectory starts; it returns
  ``(instance_id, ToolResponse)`` (the response is not shown to the model, as in verl);
- ``execute(instance_id, parameters)`` for each call the model makes, returning ``(ToolResponse, step_reward,
  metrics)``;
- ``calc_reward(instance_id)`` when the trajectory ends (0.0 unless the tool defines it);
- ``release(instance_id)``, always, also when the trajectory failed or was cancelled.

Differences from verl: the schema is logged (at INFO) rather than printed; a tool with no schema raises a
``ValueError`` saying how to give one (verl's assert fails first with an AttributeError); ``execute`` is not wrapped in
verl's ``rollout_trace_op``.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import uuid4

from rlworkers.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)


class BaseTool:
    """Base class for tools.

    A tool should support the following methods:

    - `get_openai_tool_schema`: return the tool schema in OpenAI format.
    - `create`: create a tool instance for a trajectory.
    - `execute`: execute the tool.
    - `calc_reward`: calculate the reward respect to tool state.
    - `release`: release the tool instance.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(
                f"tool {type(self).__name__} has no tool_schema. Fix: give `tool_schema` in the tool config, or "
                "override get_openai_tool_schema() to return an OpenAIFunctionToolSchema"
            )
        self.name = self.tool_schema.function.name
        logger.info(
            "tool %s: %s", self.name, json.dumps(self.tool_schema.model_dump(exclude_unset=True, exclude_none=True))
        )

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Create a tool instance.

        Args:
            instance_id: The instance id of the tool.

        Returns:
            The instance id of the tool.
            tool_creation_response: The response of the tool when creating the instance.
        """
        if instance_id is None:
            return str(uuid4()), ToolResponse()
        else:
            return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Execute the tool.

        Args:
            instance_id: The instance id of the tool.
            parameters: The parameters of the tool call (the decoded JSON object).

        Returns: tool_response, tool_reward_score, tool_metrics
            tool_response: The ToolResponse object containing text, image, and/or video content.
            tool_reward_score: The step reward score of the tool.
            tool_metrics: The metrics of the tool.
        """
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """Calculate the reward of the tool.

        Args:
            instance_id: The instance id of the tool.

        Returns:
            The reward of the tool.
        """
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Release the tool instance.

        Args:
            instance_id: The instance id of the tool.
        """
        pass
