"""The operators' page (``/dashboard``): ``page.html`` and ``page.js``, files of this package served as they are
(no build step, nothing from elsewhere), poll ``/dashboard/state`` (``snapshot``) once a second and draw the cluster,
the traffic, the transfers and the prefix and disaggregation figures with plain DOM and inline SVG. Every string
goes in as text, never as markup. With an API key set the page asks for it once and sends it as a bearer token."""
