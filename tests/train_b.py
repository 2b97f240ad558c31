"""Script B of `test_autoresume.py`: `autoresume_script.py`'s code under another script name, so another run in the same folder."""
from pathlib import Path
exec(compile((Path(__file__).parent/'autoresume_script.py').read_text(), __file__, 'exec'))
