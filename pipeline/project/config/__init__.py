"""The registry: params.yaml parsed once into typed models.

Errors name the YAML key path and suggest the nearest valid key. Nothing outside this package
reads params.yaml as a raw dict.

The package on its seams: ``model`` (the model side of the schema), ``sku`` (the SKU side and the
project-wide settings), ``registry`` (the Registry), ``load`` (reading the file and the checks that
span entries, which consult the backend table).
"""

from pipeline.project.config.base import (
    CLASS_KINDS,
    DTYPES,
    OUTPUT_KINDS,
    PRECISIONS,
    DType,
    Precision,
    Strict,
)
from pipeline.project.config.load import (
    load_registry,
    parse_registry,
)
from pipeline.project.config.model import (
    BenchSpec,
    BoxesNms,
    CtcGreedy,
    Datasets,
    DatasetSource,
    DbBoxes,
    GenerateSpec,
    InputSpec,
    MetricGate,
    ModelSpec,
    Segment,
    SequenceSpec,
    SustainedSpec,
    TaskTolerance,
    Tolerance,
    TolerancePolicy,
    TopK,
)
from pipeline.project.config.pair import (
    Pair,
)
from pipeline.project.config.preprocessing import (
    PREPROCESSING_STEPS,
    DevicePreprocessing,
    FilePreprocessing,
    device_preprocessing,
    resize_problem,
)
from pipeline.project.config.registry import (
    Registry,
)
from pipeline.project.config.sku import (
    NAME_FORBIDDEN,
    NAME_PATTERN,
    Expiry,
    HealthGates,
    KnownGap,
    PerformanceGate,
    Profile,
    Release,
    RolloutSpec,
    SelectionSpec,
    SigningSpec,
    SkuSpec,
    Target,
    TrackingSpec,
    Wave,
    device_class_problem,
    name_problem,
    suggest_name,
)

__all__ = [
    "BenchSpec",
    "BoxesNms",
    "CLASS_KINDS",
    "CtcGreedy",
    "DTYPES",
    "DType",
    "DatasetSource",
    "Datasets",
    "DbBoxes",
    "DevicePreprocessing",
    "Expiry",
    "FilePreprocessing",
    "GenerateSpec",
    "HealthGates",
    "InputSpec",
    "KnownGap",
    "MetricGate",
    "ModelSpec",
    "NAME_FORBIDDEN",
    "NAME_PATTERN",
    "OUTPUT_KINDS",
    "PRECISIONS",
    "PREPROCESSING_STEPS",
    "PerformanceGate",
    "Precision",
    "Profile",
    "Registry",
    "Release",
    "RolloutSpec",
    "Segment",
    "SelectionSpec",
    "SequenceSpec",
    "SigningSpec",
    "SkuSpec",
    "Pair",
    "Strict",
    "SustainedSpec",
    "Target",
    "TaskTolerance",
    "Tolerance",
    "TolerancePolicy",
    "TopK",
    "TrackingSpec",
    "Wave",
    "device_class_problem",
    "device_preprocessing",
    "load_registry",
    "name_problem",
    "parse_registry",
    "resize_problem",
    "suggest_name",
]
