from engine_proc.engine import main
from shared.process_config import exit_now

exit_now(main())
