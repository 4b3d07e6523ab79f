"""Multi-agent workflows: DAGs of agent calls, embedded tasks with verifiable rewards, reward allocation.

Pure Python (no JAX): the executor talks to a `GenerationBackend` (the rollout engine, or `ScriptedBackend`
in tests) and hands every agent call to an `ExperienceSink` (the orchestrator maps it into the store).
"""

from flexmarl_jax.workflows.builtin import (
    WORKFLOW_BUILDERS,
    build_configured_workflow,
    build_workflow,
    register_workflow,
    workflow_roles,
)
from flexmarl_jax.workflows.dataset import DatasetError, JsonlTask, read_jsonl_dataset, read_jsonl_records
from flexmarl_jax.workflows.executor import (
    AgentLoad,
    CallTiming,
    RunResult,
    TrajectoryResult,
    WorkflowExecutionError,
    WorkflowExecutor,
)
from flexmarl_jax.workflows.generation import (
    ChatPrompt,
    Completion,
    GenerationBackend,
    GenerationRequest,
    SamplingParams,
)
from flexmarl_jax.workflows.graph import (
    Edge,
    Node,
    NodeOutput,
    RewardWeights,
    ShapingTerm,
    Workflow,
    WorkflowError,
)
from flexmarl_jax.workflows.math_answers import MathAnswerChecker, extract_final_answer
from flexmarl_jax.workflows.records import CallRecord, ExperienceSink, InMemorySink
from flexmarl_jax.workflows.rewards import TrajectoryContext, allocate_rewards
from flexmarl_jax.workflows.scripted import ScriptedAgent, ScriptedBackend
from flexmarl_jax.workflows.tasks import (
    TASK_BUILDERS,
    ArithmeticTask,
    CountdownTask,
    Problem,
    ReverseTask,
    Task,
    build_task,
    resolve_task,
)
from flexmarl_jax.workflows.word_problems import WordProblemTask  # registers "word_problems"

__all__ = [
    "ChatPrompt",
    "AgentLoad",
    "ArithmeticTask",
    "CallRecord",
    "CallTiming",
    "Completion",
    "CountdownTask",
    "DatasetError",
    "Edge",
    "ExperienceSink",
    "GenerationBackend",
    "GenerationRequest",
    "InMemorySink",
    "JsonlTask",
    "MathAnswerChecker",
    "Node",
    "NodeOutput",
    "Problem",
    "ReverseTask",
    "RewardWeights",
    "RunResult",
    "SamplingParams",
    "ScriptedAgent",
    "ScriptedBackend",
    "ShapingTerm",
    "TASK_BUILDERS",
    "WordProblemTask",
    "Task",
    "TrajectoryContext",
    "TrajectoryResult",
    "WORKFLOW_BUILDERS",
    "Workflow",
    "WorkflowError",
    "WorkflowExecutionError",
    "WorkflowExecutor",
    "allocate_rewards",
    "build_configured_workflow",
    "build_task",
    "build_workflow",
    "extract_final_answer",
    "read_jsonl_dataset",
    "read_jsonl_records",
    "register_workflow",
    "resolve_task",
    "workflow_roles",
]
