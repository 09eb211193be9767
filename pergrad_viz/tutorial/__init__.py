"""The tutorial's material: the bundled Fashion-MNIST sample and its loader (:mod:`.data`), the full dataset
(:mod:`.fashion_mnist`), the tutorial's networks (:mod:`.networks`), label noise (:mod:`.label_noise`) and tiny
Hugging Face / timm / peft models built from configs (:mod:`.hf_models`)."""
