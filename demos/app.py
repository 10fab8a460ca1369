"""The multistream demo page: ``python demos/app.py`` (or ``gradio demos/app.py`` to hot-reload).

Chat with the embedded SmolLM2, watch the embedded image model denoise step by step, and let the
LLM write a prompt that the image model then draws, watch every frame of a clip denoise in the
Video tab, all streaming live through one protocol.
Same page as ``multistream demo``; set MULTISTREAM_DEMO_PORT to change the port.
"""

from __future__ import annotations

import os

from multistream.ui.demo import create_demo

demo = create_demo()

if __name__ == "__main__":
    demo.launch(server_name=os.environ.get("MULTISTREAM_DEMO_HOST", "127.0.0.1"),
                server_port=int(os.environ.get("MULTISTREAM_DEMO_PORT", "7860")), share=False)
