"""A text training script for the kill-and-rerun tests: a language model, or a text classifier trained ULMFiT-style, on a synthetic corpus.

`ulmfit` freezes the classifier before its first fit call; `ulmfit_docs` is the recipe as fastai's docs write it, on a model
that is not pretrained, which `text_classifier_learner` leaves unfrozen: fit call 1 trains every layer, and `freeze_to(-2)` then
freezes layers that hold (zeroed) gradients, which fastai's optimizer still steps (weight decay)."""
import argparse
import numpy as np, pandas as pd, torch
from fastai.text.all import *
from killrerun import Report, Draws, save_result

p = argparse.ArgumentParser()
p.add_argument('out')
p.add_argument('--task', choices=['lm', 'ulmfit', 'ulmfit_docs', 'fine_tune'], default='lm')
p.add_argument('--no-resume', action='store_true', help='stock fastai: the package never imported')
p.add_argument('--then', action='store_true', help='another fit call after the task\'s own')
p.add_argument('--cached', action='store_true', help="the language model's fit call cached: `learn.save('stage1')`, loaded when found")
p.add_argument('--plain', action='store_true', help='the package imported (its `Learner.save`/`load`), without `AutoResume`')
a = p.parse_args()
if not a.no_resume: from resumable_train.autoresume import AutoResume

def corpus(n=160, seed=0):
    "`n` short documents over 12 words; the label says whether the first word is one of the first six"
    rs = np.random.RandomState(seed)
    words = [f'w{i}' for i in range(12)]
    docs = [list(rs.choice(words, rs.randint(4, 20))) for _ in range(n)]
    return pd.DataFrame({'text': [' '.join(d) for d in docs], 'label': [int(d[0] in words[:6]) for d in docs]})

torch.set_num_threads(1)
set_seed(42, reproducible=True)
df,tiny = corpus(),dict(emb_sz=16, n_hid=32, n_layers=2)
cbs = [Report(), Draws(), CSVLogger(append=True)] + ([] if a.no_resume or a.plain else [AutoResume(every_iter=3, verbose=False)])
if a.task == 'lm':
    dls = TextDataLoaders.from_df(df, text_col='text', is_lm=True, valid_pct=0.2, seed=42, bs=8, seq_len=10, tok_tfm=BaseTokenizer())
    learn = language_model_learner(dls, AWD_LSTM, pretrained=False, config=dict(awd_lstm_lm_config, **tiny), metrics=accuracy, cbs=cbs, path='.')
else:
    dls = TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=0.2, seed=42, bs=8, tok_tfm=BaseTokenizer())
    learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, seq_len=8, config=dict(awd_lstm_clas_config, **tiny),
                                    metrics=accuracy, cbs=cbs, path='.')
with learn.no_bar():
    if a.task == 'lm' and a.cached and Path('models/stage1.pth').exists():
        learn.load('stage1')
        learn.n_fit = 0  # the cached stage stands for the first fit call: `Report` numbers the next one 1
    elif a.task == 'lm':
        learn.fit_one_cycle(3, 1e-2)
        if a.cached: learn.save('stage1')
    elif a.task == 'fine_tune': learn.fine_tune(2, 1e-2, freeze_epochs=1)
    else:  # ULMFiT's gradual unfreezing
        if a.task == 'ulmfit': learn.freeze()
        learn.fit_one_cycle(1, 2e-2)
        learn.freeze_to(-2)
        learn.fit_one_cycle(1, slice(1e-2/(2.6**4), 1e-2))
        learn.unfreeze()
        learn.fit_one_cycle(2, slice(1e-3/(2.6**4), 1e-3))
    if a.then: learn.fit_one_cycle(1, 1e-3)
save_result(learn, a.out)
print('DONE', flush=True)
