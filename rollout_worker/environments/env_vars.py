"""What an environment's process may read of the worker's environment variables: an allowlist, never the rest.

The worker holds the bucket's credentials (AWS_*, a gs:// or hf:// token), the pool token and the proxy's admin
token in its environment. An environment is the user's code and the libraries it imports: whatever it could read
it could also send away. So its process (host.py) starts with only the variables below, plus the names a run adds
with `--rollout.environment-env NAME,NAME`; PYTHONPATH is set to the worker's import path so that the environment's
module imports as it does in the worker. A name that holds a credential brigade itself uses cannot be added: the
setting is refused when it is read (rollout_worker/config.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

# What a Python process and the libraries environments use need to run as they do in the worker: where programs
# and home are, the locale, temporary folders, the interpreter's own switches, CA bundles for an https endpoint
# (OpenEnv), thread counts (two cores are shared by every process here: an environment must not start a thread
# per core), and offline switches of the hubs and nltk's data folder (TextArena's word games read it).
ALLOWED = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "TEMP",
    "TMP",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONWARNINGS",
    "PYTHONIOENCODING",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "RAYON_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "NLTK_DATA",
)

# Credentials of the bucket (s3fs/boto, gcsfs, huggingface_hub, azure) and brigade's own tokens: never passed, even
# when named. A run's own secret for its environment (an API key of a judge, say) goes under another name.
_SECRET = re.compile(r"^(AWS_|BRIGADE_|GOOGLE_|GCLOUD_|CLOUDSDK_|AZURE_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)")


def is_secret(name: str, pool_token_env: str = "BRIGADE_POOL_TOKEN") -> bool:
    """A name whose value a bucket or brigade authenticates with: an environment never gets it."""
    return bool(_SECRET.match(name)) or name == pool_token_env


def environment_of(
    extra: Iterable[str] = (), python_path: str = "", source: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment process's variables: the allowlist and `extra`, those set in `source` (the worker's own
    environment by default), with PYTHONPATH = `python_path`; never a secret, whatever `extra` says."""
    source = os.environ if source is None else source
    names = [n for n in (*ALLOWED, *extra) if not is_secret(n)]
    env = {n: source[n] for n in names if n in source}
    if python_path:
        env["PYTHONPATH"] = python_path
    return env
