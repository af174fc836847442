#!/usr/bin/env python3
"""The module graph of a crate's library and whether it has a circle.

    python3 tools/module_cycles.py crates/ffn-train/src
    python3 tools/module_cycles.py crates/ffn-model/src

An edge `a -> b` is a path that module `a` names outside its tests: `crate::b::…`, `super::…`,
`use crate::{b, …}`, a child `b` that `a` re-exports, `use super::*`, and a name the crate root
re-exports (resolved to the module that defines it). Doc comments are skipped. Prints every
module's edges, then the circles (exit status 1 when there is one): the check of the module
graph that `cargo modules` would give, without its install.
"""
import re,os,sys
files={}
os.chdir(sys.argv[1] if len(sys.argv) > 1 else '.')
for root,_,fs in os.walk('.'):
    for f in fs:
        if f.endswith('.rs'):
            p=os.path.join(root,f)[2:]
            m=re.sub(r'/mod$','',p[:-3]).replace('/','::')
            if m in ('lib','main'): m='crate' if m=='lib' else 'main'
            files[m]=open(p).read()
mods=set(files)
# root re-exports: name -> module
reexp={}
for grp_mod, names in re.findall(r'pub use (\w+(?:::\w+)*)::\{([^}]*)\}', files.get('crate','')):
    for n in names.split(','):
        n=n.strip().split(' as ')[-1]
        if n: reexp[n]=grp_mod
for mod_, n in re.findall(r'pub use (\w+(?:::\w+)*)::(\w+);', files.get('crate','')):
    reexp[n]=mod_
def norm(path):
    parts=[x for x in path.split('::') if x]
    if parts and parts[0] in reexp and parts[0] not in mods:
        parts=reexp[parts[0]].split('::')+parts[1:]
    best=None
    for i in range(1,len(parts)+1):
        cand='::'.join(parts[:i])
        if cand in mods: best=cand
    return best
edges=set()
for m,s in files.items():
    if m in ('crate','main'): continue
    body=re.split(r'#\[cfg\(test\)\]\s*\n\s*(pub(\(crate\))? )?mod tests', s)[0]
    body='\n'.join(l for l in body.split('\n') if not l.strip().startswith('//'))
    parent='::'.join(m.split('::')[:-1])
    def add(path):
        t=norm(path)
        if t and t!=m and not m.startswith(t+'::'): edges.add((m,t))
    for u in re.findall(r'crate::((?:\w+::)*\w+)', body): add(u)
    for u in re.findall(r'super::((?:\w+::)*\w+)', body): add((parent+'::' if parent else '')+u)
    if re.search(r'use super::\*;', body) and parent: add(parent)
    for grp in re.findall(r'use crate::\{([^;]*)\};', body, re.S):
        for item in re.split(r',\s*(?![^{]*\})', grp): add(item.strip().split('::{')[0])
    for grp in re.findall(r'use super::\{([^;]*)\};', body, re.S):
        for item in re.split(r',\s*(?![^{]*\})', grp): add((parent+'::' if parent else '')+item.strip().split('::{')[0])
    for u in re.findall(r'(?:pub )?use (\w+)::', body):
        cand=m+'::'+u
        if cand in mods: edges.add((m,cand))
g={}
for a,b in edges: g.setdefault(a,set()).add(b)
for a in sorted(g): print(a,'->',' '.join(sorted(g[a])))
color={}; stack=[]; cycles=[]
def dfs(u):
    color[u]=1; stack.append(u)
    for v in sorted(g.get(u,())):
        if color.get(v)==1: cycles.append(stack[stack.index(v):]+[v])
        elif not color.get(v): dfs(v)
    stack.pop(); color[u]=2
for u in sorted(mods):
    if not color.get(u): dfs(u)
print('cycles:', cycles or 'none')
sys.exit(1 if cycles else 0)
