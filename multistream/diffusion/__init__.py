"""What the denoising families (`multistream.image`, `multistream.video`) share, one layer below them.

A run's checkpoints (`_checkpoint`), the engine's interleaving of requests step by step
(`_stepper`, `_denoiser_batch`), a request's preview job (`_job`), preview decoders and what
``preview=`` asks for (`_previews`, `_preview_options`, `_latent_rgb`, `_preview_decoder`) and the
sizes a model makes (`_sizes`). Private: their public names are re-exported by `multistream.image`
(``ImageCheckpoint``, ``fit_preview_decoder``, ...) and `multistream.video`, which import this
package and not each other.

Example:
    >>> from multistream.diffusion._preview_options import parse_preview
    >>> parse_preview("x0").source
    'x0'
"""
