"""Config layer: pydantic schemas for config.json and multidatabackend.json, SimpleTuner-format loading,
versioned migrations and the model-family table.

Pure pydantic: nothing here imports torch, diffusers, transformers or any other simpletuner layer.
"""

from .data import (
    DataBackends,
    DatasetBackend,
    TextEmbedsBackend,
    data_backend_beside,
    found_beside_message,
    load_data_backends,
    parse_data_backends,
)
from .errors import ConfigError, FieldError
from .families import FAMILIES, ModelFamily, family_names, get_family
from .loader import (
    LoadedConfig,
    dump_train_config,
    load_train_config,
    prepare_train_config,
    write_train_config,
)
from .train import (
    TrainConfig,
    TreadConfig,
    TreadRoute,
    WebhookConfig,
    check_train_paths,
    flavour_path_errors,
    resolve_tread_routes,
)
from .versions import CURRENT_CONFIG_VERSION, migrate

__all__ = [
    "CURRENT_CONFIG_VERSION",
    "ConfigError",
    "DataBackends",
    "DatasetBackend",
    "FAMILIES",
    "FieldError",
    "LoadedConfig",
    "ModelFamily",
    "TextEmbedsBackend",
    "TrainConfig",
    "TreadConfig",
    "TreadRoute",
    "WebhookConfig",
    "check_train_paths",
    "data_backend_beside",
    "found_beside_message",
    "dump_train_config",
    "family_names",
    "flavour_path_errors",
    "get_family",
    "load_data_backends",
    "load_train_config",
    "migrate",
    "parse_data_backends",
    "prepare_train_config",
    "resolve_tread_routes",
    "write_train_config",
]
