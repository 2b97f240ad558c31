"""Another script in the same folder: runs the test script that `RT_SCRIPT` names (beside this file) under this file's name. The
package tells two runs in one folder apart by their script's name alone, so this is another run than the script run as itself."""
import os
from pathlib import Path
exec(compile((Path(__file__).parent/os.environ['RT_SCRIPT']).read_text(), __file__, 'exec'))
