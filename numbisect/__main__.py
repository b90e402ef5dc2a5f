# Before anything else is imported: `python -m numbisect` put the working directory first on
# sys.path, where a json.py or ctypes.py would shadow the standard library's.
from numbisect.common.procenv import no_code_from_cwd

no_code_from_cwd(entry=True)

from numbisect.cli import main  # noqa: E402 (after the import path is made safe)

if __name__ == "__main__":
    raise SystemExit(main())
