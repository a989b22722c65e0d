// MathJax configuration for the formulas that pymdownx.arithmatex (generic mode) and the
// docstrings' :math: roles write as \( ... \) and \[ ... \].  Loaded before the MathJax
// script itself (extra_javascript in mkdocs.yml).
//
// MathJax is served with the site, not from a CDN, so formulas render offline:
// tex-chtml-full.js and output/chtml/fonts/woff-v2/ are copied unchanged from the npm
// package mathjax@3.2.2 (es5/), Apache License 2.0 (LICENSE in this folder).  The "full"
// build contains every TeX extension, so no extension is fetched at run time.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    // only the spans and blocks made by arithmatex, never other text or code
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};
