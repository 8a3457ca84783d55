"""gumiho_core: a lossless Gumiho speculative-decoding engine for Hugging Face causal LMs."""
from .drafter import Drafter, DraftStep, GumihoDrafter, PlainDrafter, RecordingDrafter
from .errors import ContextTooLong, GumihoError
from .events import DoneEvent, GenerationStats, StepEvent, TokenPiece
from .generate import Engine, run_to_end
from .heads import GumihoHeads, HeadCheckpoint, HeadConfig, new_heads
from .settings import GenerationSettings, SamplingSettings, TreeSettings
from .target import Target, load_target

__all__ = [
    "ContextTooLong", "DoneEvent", "DraftStep", "Drafter", "Engine", "GenerationSettings", "GenerationStats",
    "GumihoDrafter", "GumihoError", "GumihoHeads", "HeadCheckpoint", "HeadConfig", "PlainDrafter",
    "RecordingDrafter", "SamplingSettings", "StepEvent", "Target", "TokenPiece", "TreeSettings", "load_target",
    "new_heads", "run_to_end",
]
